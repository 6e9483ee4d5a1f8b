"""Gradient buckets launch in the order their gradients became ready in the first backward.

Two towers in two param groups, ``a``'s first: the fixed order launches ``a``'s bucket first.
Rank 0 runs ``b(a(x))``, so ``b``'s gradients are ready first there; the other ranks run
``a(b(x))``. After the first backward every rank must launch rank 0's order — ``b``'s bucket
first — and still train bitwise like DDP.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard
from zeroshard.comm import collectives

STEPS = 4


class Towers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)  # 80 elements with the gap that starts its weight on 64 bytes: its bucket is told apart by size
        self.b = nn.Linear(8, 8, bias=False)  # 64 elements

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) if dist.get_rank() == 0 else self.a(self.b(x))


def _launches(opt, model, ref, x) -> list[str]:
    """The towers' buckets in the order this rank launched their reduce-scatters in one backward."""
    launched = []
    real = collectives.reduce_scatter

    def recording(output, input, group, **kwargs):
        launched.append({80: "a", 64: "b"}[input.numel()])
        return real(output, input, group, **kwargs)

    collectives.reduce_scatter = recording
    try:
        model(x).square().sum().backward()
    finally:
        collectives.reduce_scatter = real
    ref(x).square().sum().backward()
    return launched


def order_worker(stage: int, hybrid: bool) -> tuple[list[list[str]], bool]:
    """Per step, this rank's launch order; and whether the params equal DDP + AdamW's bitwise throughout."""
    torch.manual_seed(0)
    ref_model = Towers()
    model = copy.deepcopy(ref_model)
    ref = DDP(ref_model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    group = zeroshard.hybrid_mesh(2) if hybrid else None
    groups = [{"params": list(model.a.parameters())}, {"params": list(model.b.parameters())}]
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(groups, lr=1e-2, foreach=False), stage=stage, process_group=group)
    orders, equal = [], True
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        orders.append(_launches(opt, model, ref, x))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        equal = equal and all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))
    return orders, equal


@pytest.mark.parametrize("stage", [1, 2])
def test_buckets_launch_in_rank_zeros_ready_order_after_the_first_backward(pools, stage):
    for rank, (orders, equal) in enumerate(pools[2].run(order_worker, stage, False)):
        assert orders[0] == ["a", "b"], (rank, orders)  # the first backward: param-group order
        assert all(order == ["b", "a"] for order in orders[1:]), (rank, orders)  # then rank 0's, on every rank
        assert equal, rank  # parity with DDP unchanged


def test_hybrid_sharding_agrees_on_one_order_across_replicas(pools):
    results = pools[4].run(order_worker, 2, True)
    for rank, (orders, _) in enumerate(results):
        assert all(order == ["b", "a"] for order in orders[1:]), (rank, orders)
