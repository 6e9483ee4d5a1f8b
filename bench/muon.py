"""``muon`` suite: the sharded Muon step against torch's unsharded Muon at 2 ranks, and its state bytes.

The Muon half of the Muon + AdamW recipe (``examples/train_gpt.py --optimizer muon``):
``torch.optim.Muon`` on the 2-D weight matrices of the example GPT's blocks (attention and MLP).
Each rank's gradients are fixed random matrices (different per rank). The sharded optimizers get
them through autograd, reduced to their owners during that backward, and the unsharded baseline
gets their mean over the ranks (what DDP would hand it). Untimed; then one ``step()`` is timed,
every step started together on all ranks (a barrier), methods taking turns in rounds:

* ``torch_muon`` (the baseline): ``torch.optim.Muon.step()`` on every matrix, as each rank runs it
  under DDP.
* ``zeroshard_muon``: ``ShardedOptimizer(Muon).step()`` (``partition="param"``): each rank
  orthogonalizes the matrices it owns, then the updated params are all-gathered.
* ``all_gather``: that all-gather alone, the same collectives on the same buffers.
* ``zeroshard_adamw``: ``ShardedOptimizer(AdamW).step()`` on the same matrices (``partition="flat"``).

Ratios: ``zeroshard_muon / torch_muon``, goal ``1/N + all_gather / torch_muon`` (each matrix
orthogonalized once, by its owner, plus the gather); ``zeroshard_muon / zeroshard_adamw``.

State: per rank, the bytes ``memory_usage()`` counts as ``optimizer_state`` and ``master`` for
``ShardedOptimizer(Muon)``, against the 1/N ideal: torch Muon's state (one momentum buffer per
matrix, counted tensor by tensor) over N. Goal: <= 1.10x on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from bench import gpt
from bench.harness import RATIO_LEGEND, Table, Timing, progress, run_ranks
from zeroshard.comm import collectives
from zeroshard.layout.chunk import chunks_of

METHODS = ("torch_muon", "zeroshard_muon", "all_gather", "zeroshard_adamw")
WORLD_SIZE = 2
# The example's Muon setting (examples/train_gpt.py, build_optimizers); lr and decay do not change the time.
MUON = {"lr": 2e-3, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True, "adjust_lr_fn": "match_rms_adamw"}
ADAMW = {"lr": 2e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
SUMMARY = "the sharded Muon step vs torch's unsharded Muon at 2 ranks; Muon state bytes vs 1/N"
TABLES = (
    Table(("time", "ratio"), "median_ms, p20_ms, p80_ms: one step() after a backward that reduced the gradients (all_gather: the gather "
                             f"that ends zeroshard_muon's step, alone); {RATIO_LEGEND}; goal: zeroshard_muon / torch_muon <= this"),
    Table(("state",), "MiB per rank after the timed steps: state = optimizer_state + master of memory_usage() (torch_muon: its state "
                      "tensors); ideal = torch_muon's state / N; vs_ideal = state / ideal (goal <= 1.10); params, grad_shard: the "
                      "wrapper's flat buffers, padding included (torch_muon: the matrices)"),
)


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The 2-D weights of the blocks: what the example hands Muon."""
    return [p for block in model.blocks for p in block.parameters() if p.dim() == 2]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(prepare: Callable[[], None], fn: Callable[[], None], steps: int, device: torch.device) -> list[float]:
    """Seconds of ``fn`` alone, ``steps`` times: ``prepare()`` untimed before each, every call started on all ranks together."""
    times = []
    for _ in range(steps):
        prepare()
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))


def rank_main(config: gpt.GPTConfig, rounds: int, steps: int, warmup: int) -> dict:
    """Step times per method and this rank's bytes (see the module docstring)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    shapes = [p.shape for p in hidden_matrices(gpt.build(config, device))]
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())
    grads = [torch.randn(shape, generator=generator).to(device) for shape in shapes]  # this rank's gradients

    def backward(params: list[nn.Parameter]) -> Callable[[], None]:
        # The gradients arrive through autograd, so the wrappers' hooks reduce them during backward, as in training.
        return lambda: sum((p * g).sum() for p, g in zip(params, grads)).backward()

    unsharded = hidden_matrices(gpt.build(config, device))
    for p, g in zip(unsharded, grads):
        p.grad = g.clone()
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()  # the data-parallel gradient; Muon leaves .grad in place, so every step reuses it
    torch_muon = torch.optim.Muon(unsharded, **MUON)
    muon_params, adamw_params = (hidden_matrices(gpt.build(config, device)) for _ in range(2))
    zeroshard_muon = zeroshard.ShardedOptimizer(torch.optim.Muon(muon_params, **MUON), stage=2)
    zeroshard_adamw = zeroshard.ShardedOptimizer(torch.optim.AdamW(adamw_params, **ADAMW), stage=2)

    def all_gather() -> None:
        works = [collectives.all_gather(c.bucket_params, c.params, zeroshard_muon.process_group) for c in chunks_of(zeroshard_muon._shards)]
        for work in works:
            work.wait()

    calls = {  # method -> (prepare, timed)
        "torch_muon": (lambda: None, torch_muon.step),
        "zeroshard_muon": (backward(muon_params), zeroshard_muon.step),
        "all_gather": (lambda: None, all_gather),
        "zeroshard_adamw": (backward(adamw_params), zeroshard_adamw.step),
    }
    for prepare, fn in calls.values():
        _timed(prepare, fn, warmup, device)  # allocates state
    samples: dict[str, list[float]] = {m: [] for m in METHODS}
    for _ in range(rounds):
        for method, (prepare, fn) in calls.items():
            samples[method] += _timed(prepare, fn, steps, device)
    usage = zeroshard_muon.memory_usage().by_kind
    return {
        "samples": samples,
        "partition": zeroshard_muon.partition,
        "torch_muon": {"state": _state_bytes(torch_muon), "params": sum(p.numel() * p.element_size() for p in unsharded), "grad_shard": 0},
        "zeroshard_muon": {"state": usage["optimizer_state"] + usage["master"], "params": usage["params"], "grad_shard": usage["grad_shard"]},
    }


def run(quick: bool) -> list[dict]:
    """Rows: one per method's time, the two ratios, then the state bytes (torch Muon's, and each rank's sharded)."""
    config = gpt.QUICK if quick else (gpt.FULL_GPU if torch.cuda.is_available() else gpt.FULL_CPU)
    rounds, steps, warmup = (2, 2, 1) if quick else (10, 5, 2)
    progress("muon", f"timing {len(METHODS)} methods at {WORLD_SIZE} ranks, {rounds} rounds x {steps} steps each ({config})")
    per_rank = run_ranks(rank_main, WORLD_SIZE, config, rounds, steps, warmup)
    if per_rank[0]["partition"] != "param":
        raise RuntimeError(f"ShardedOptimizer(Muon) chose partition={per_rank[0]['partition']!r}, expected 'param'")
    timings = {m: Timing(m, tuple(s)) for m, s in per_rank[0]["samples"].items()}
    rows = [{"kind": "time", "method": m, "baseline": "", "median_ms": t.median * 1e3, "p20_ms": t.p20 * 1e3, "p80_ms": t.p80 * 1e3,
             "ratio": "", "goal": ""} for m, t in timings.items()]
    torch_ms, gather_ms = timings["torch_muon"].median, timings["all_gather"].median
    for method, baseline, goal in (("zeroshard_muon", "torch_muon", 1 / WORLD_SIZE + gather_ms / torch_ms), ("zeroshard_muon", "zeroshard_adamw", "")):
        rows.append({"kind": "ratio", "method": method, "baseline": baseline, "median_ms": "", "p20_ms": "", "p80_ms": "",
                     "ratio": timings[method].median / timings[baseline].median, "goal": goal})
    ideal = per_rank[0]["torch_muon"]["state"] / WORLD_SIZE
    rows.append(_state_row("torch_muon", "every", per_rank[0]["torch_muon"], ideal))
    return rows + [_state_row("zeroshard_muon", rank, answer["zeroshard_muon"], ideal) for rank, answer in enumerate(per_rank)]


def _state_row(method: str, rank: int | str, held: dict[str, int], ideal: float) -> dict:
    return {"kind": "state", "method": method, "rank": rank, "state_MiB": held["state"] / 2**20, "ideal_MiB": ideal / 2**20,
            "vs_ideal": held["state"] / ideal, "params_MiB": held["params"] / 2**20, "grad_shard_MiB": held["grad_shard"] / 2**20}
