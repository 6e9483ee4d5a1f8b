"""Hybrid (MiCS) sharding and subgroups on 4 gloo ranks, against DDP + AdamW."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from models import TinyNet, param_groups
from test_parity import _same_on_all_ranks, _train_pair

import zeroshard


def hybrid_parity_worker(shard_size: int, stage: int, accumulation: str, offload: str | None = None) -> tuple[float, bool, int, int]:
    """Worst tolerance ratio against DDP over the world, params equal on all 4 ranks after every
    step, and this rank's exp_avg + exp_avg_sq bytes next to DDP's."""
    mesh = zeroshard.hybrid_mesh(shard_size)
    worst, identical = 0.0, True
    from models import tolerance_ratio

    for ref_model, model, opt in _train_pair(stage, accumulation, True, process_group=mesh, offload=offload):  # noqa: B007 (opt: read after the loop)
        worst = max(worst, tolerance_ratio(model, ref_model))
        identical &= _same_on_all_ranks(model)
    moments = sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items() if k != "step")
    unsharded = 8 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    return worst, identical, moments, unsharded


@pytest.mark.parametrize("shard_size, stage, accumulation, offload", [
    (1, 2, "none", None), (2, 1, "none", None), (2, 2, "none", None), (2, 2, "no_sync", None), (4, 2, "backward", None), (2, 2, "none", "cpu"),
])
def test_hybrid_parity_with_ddp(pools, shard_size, stage, accumulation, offload):
    results = pools[4].run(hybrid_parity_worker, shard_size, stage, accumulation, offload)
    for worst, identical, _, _ in results:
        assert identical, "params differ between ranks"
        assert worst <= 1.0, f"params off DDP + AdamW by {worst:.3g}x the tolerance (rtol 1e-6, atol 1e-7)"
    # Optimizer state follows the shard size, not the world size: each shard group holds one copy.
    for start in range(0, 4, shard_size):
        assert sum(r[2] for r in results[start : start + shard_size]) == results[0][3]
    if shard_size == 2:
        assert all(moments <= 0.5 * unsharded * 1.05 for _, _, moments, unsharded in results)


def subgroups_worker() -> tuple[float, bool, list[float]]:
    """Ranks {0, 1} and {2, 3} each train their own replica on their own process group."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[dist.get_rank() // 2]
    worst = 0.0
    for ref_model, model, _ in _train_pair(2, "none", True, process_group=mine, ddp_group=mine):
        from models import tolerance_ratio

        worst = max(worst, tolerance_ratio(model, ref_model))
    first = [float(p.detach().reshape(-1)[0]) for p in model.parameters()]
    return worst, _same_on_all_ranks(model, mine), first


def test_independent_subgroups_train_their_own_replicas(pools):
    results = pools[4].run(subgroups_worker)
    for worst, identical, _ in results:
        assert identical and worst <= 1.0, worst
    assert results[0][2] == results[1][2] and results[2][2] == results[3][2]
    assert results[0][2] != results[2][2]  # different data, different replicas


def bad_mesh_worker() -> None:
    with pytest.raises(ValueError, match=r"shard_size=3 must divide the world size 4: one of \[1, 2, 4\]"):
        zeroshard.hybrid_mesh(3)
    with pytest.raises(ValueError, match=r"shard_size=0 must divide"):
        zeroshard.hybrid_mesh(0)
    from torch.distributed.device_mesh import init_device_mesh

    wrong = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"dims \('dp', 'tp'\)"):
        zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(TinyNet())), process_group=wrong)
    # gloo on a machine with GPUs (as these tests run on a lent GPU machine): the mesh stays on the CPU.
    from unittest import mock

    with mock.patch("torch.cuda.is_available", return_value=True):
        assert zeroshard.hybrid_mesh(2).device_type == "cpu"


def test_bad_shard_size_or_mesh_raises_before_any_collective(pools):
    pools[4].run(bad_mesh_worker)


def hybrid_mistake_worker(mistake: str) -> str:
    """Rank 1 alone makes ``mistake`` building or using its optimizer: the error on this rank, or "no error"."""
    torch.manual_seed(0)
    model, rank = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), dist.get_rank()
    params = list(model.parameters())
    if mistake == "order" and rank == 1:  # as list(set(model.parameters())) may give
        params = [params[2], params[1], params[0], params[3]]
    options = {"stage": 1} if mistake == "option" and rank == 1 else {}
    try:
        opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(params, lr=2e-3 if mistake == "lr" and rank == 1 else 1e-3),
                                         process_group=zeroshard.hybrid_mesh(2), **options)
        opt.consolidate_state_dict(to={"to": 1, "to outside": 4}.get(mistake, 0) if rank == 1 else 0)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(("mistake", "expected"), [
    ("lr", "param_groups[0]['lr'] on rank"), ("option", "option stage on rank"),
    ("order", "the ranks list the params in different orders"), ("to", "consolidate_state_dict argument to on rank"),
    ("to outside", "consolidate_state_dict argument to on rank"),
])
def test_a_mismatch_in_one_shard_group_raises_on_every_rank(pools, mistake, expected):
    # Shard groups {0, 1} and {2, 3}: rank 1 differs from rank 0 there and from rank 3 across replicas. Rank 2 finds nothing
    # wrong itself; before the ranks agreed, it waited in the replicate group's check for rank 0, which had left.
    messages = pools[4].run(hybrid_mistake_worker, mistake, timeout=120)
    assert all(expected in m for m in (messages[0], messages[1], messages[3])), messages
    assert re.fullmatch(r".*: rank 0 found ranks that differ \(its error says more\); every rank stops here", messages[2]), messages


def add_param_group_mistake_worker() -> str:
    """Rank 1 alone passes a param already in another group to add_param_group: the error on this rank, then whether the ranks
    still run a collective together and the optimizer kept its one group."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(model[0].parameters()), process_group=zeroshard.hybrid_mesh(2), collective_timeout_s=60)
    try:
        opt.add_param_group({"params": list(model[0 if dist.get_rank() == 1 else 1].parameters())})
        message = "no error"
    except ValueError as error:
        message = str(error)
    together = torch.ones(1)
    dist.all_reduce(together)
    return f"{message} | {int(together.item())} | {len(opt.param_groups)}"


def test_add_param_group_refused_on_one_rank_raises_on_every_rank(pools):
    messages = pools[4].run(add_param_group_mistake_worker, timeout=120)
    assert messages[1].startswith("param_group holds params already in another param group") and messages[1].endswith("| 4 | 1"), messages
    for rank in (0, 2, 3):
        assert messages[rank] == "add_param_group(): rank 1 refused the param group (its error says more); every rank stops here | 4 | 1", messages
