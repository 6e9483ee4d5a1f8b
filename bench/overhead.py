"""``overhead`` suite: the host work of one training step at 2 ranks, counted in operator calls, and its time.

(On a machine with one GPU the ranks are 1: NCCL takes one GPU per rank. The rows say the world size.)

A GPU runs kernels asynchronously, so a step costs the larger of its device time and its host
(Python and dispatch) time; small params, short sequences and small per-rank batches leave the
host side longer (#27). The suite counts, for one whole training step (forward, ``backward()``,
``opt.step()``, ``opt.zero_grad()``) of each method, the operator calls that reach torch's
dispatcher, seen by a ``TorchDispatchMode`` (:class:`OpCounter`): aten operators, the host syncs
among them, and c10d collectives. The mode is active around ``backward()``, so it also sees what
gradient hooks and autograd callbacks run there (DDP's reducer, zeroshard's bucket reduction).
The step counted is a steady-state one: it follows uncounted steps and finds the last one's
all-gathers in flight, as in training. A host sync is counted where it reaches the dispatcher: a
scalar read, or a blocking copy from an accelerator into host memory; ``.tolist()`` of a CPU tensor
reads memory without dispatching anything, so on CPU ranks it goes unseen (zeroshard's step makes
one such call, its gradient-norm read, which on a GPU is a device-to-host copy and counted).

Then it times the same steps without the mode, methods taking turns in short rounds as the
``step`` suite does (:func:`bench.step.time_rounds`), and gives each method's median over the
baseline's, DDP + ``AdamW(fused=True)``, from the same run. Two sizes of the example GPT, fp32:
"small-compute" (12 blocks x 64 wide: 148 param tensors, 0.61M params; 2 x 16 tokens per rank),
where the host dominates, and "example" (4 x 256: 52 tensors, 3.24M params; 8 x 64 tokens per
rank). Each zeroshard method gets a process group of its own, as a run training one model has.

Last, for each zeroshard method, the forward that follows ``step()`` is timed alone, with the
step's param all-gathers in flight (waited for by the guard, ``zeroshard/gather/param_gather.py``)
and, alternating with it, after ``wait_params()`` with nothing in flight (#27 item 3).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

import zeroshard
from bench import gpt
from bench.harness import RATIO_LEGEND, Table, Timing, progress, ratio, run_ranks
from bench.step import ADAMW, time_rounds

BASELINE = "ddp_adamw_fused"
METHODS = (BASELINE, "ddp_adamw_foreach", "zeroshard_stage1", "zeroshard_stage2")
SIZES = {  # name -> model and per-rank batch
    "small-compute": gpt.GPTConfig(n_layer=12, n_embd=64, n_head=4, seq_len=16, batch_size=2),
    "example": gpt.GPTConfig(n_layer=4, n_embd=256, n_head=4, seq_len=64, batch_size=8),
}
# The ops that make the host wait for the device: what ``.item()``, ``float(t)``, ``bool(t)`` dispatch.
SYNC_OPS = frozenset({"aten::_local_scalar_dense", "aten::item"})
UNCOUNTED_STEPS = 3  # before the counted one
SUMMARY = "host work of a training step at 2 ranks: aten ops, host syncs, collectives, time vs DDP + fused AdamW"
TABLES = (
    Table(("overhead",), "aten_ops, host_syncs, c10d_ops: operator calls of one steady-state training step (forward, backward, "
                         "opt.step(), opt.zero_grad()) seen by a TorchDispatchMode, the busier rank's; aten_ops: aten operators, "
                         "host_syncs included; host_syncs: scalar reads (aten::_local_scalar_dense: .item(), float(t), bool(t); not of pinned memory) and "
                         "blocking device-to-host copies (.cpu(), .tolist() of a GPU tensor; .tolist() of a CPU tensor dispatches "
                         "nothing), sync_ops naming them; c10d_ops: collectives, sends and receives; median_ms: one step timed "
                         "without the mode, over all rounds; baseline: ddp_adamw_fused, DDP + AdamW(fused=True) of the same size and "
                         f"run; {RATIO_LEGEND}"),
    Table(("forward",), "pending_ms: the forward (loss included, no backward) right after step() returned with its param all-gathers "
                        "in flight, waited for by the guard (a Python call per torch function); none_ms: the same forward after opt.wait_params(), nothing in "
                        "flight; pending_over_none: pending_ms / none_ms (medians, the two alternating, rank 0's)"),
)


@dataclass(frozen=True)
class OpCounts:
    """The operator calls of one step on one rank."""

    aten: int
    c10d: int
    host_syncs: Counter[str]  # op name -> calls

    @staticmethod
    def busiest(ranks: list[OpCounts]) -> OpCounts:
        """Each count's largest value over ``ranks`` (ranks of a sharded optimizer can do different work)."""
        syncs: Counter[str] = Counter()
        for counts in ranks:
            syncs |= counts.host_syncs  # elementwise max
        return OpCounts(max(c.aten for c in ranks), max(c.c10d for c in ranks), syncs)


def is_host_sync(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether the call ``name(*args, **kwargs)`` makes the host wait for the device: a scalar read, or a
    blocking copy from an accelerator into host memory (``.cpu()`` or ``.tolist()`` of a GPU tensor)."""
    if name in SYNC_OPS:  # except a read of pinned host memory (a flag copied there behind an event: zeroshard/step/pending_skip.py)
        return not (args[0].device.type == "cpu" and args[0].is_pinned())
    if name == "aten::_to_copy":
        target = kwargs.get("device")
        return args[0].device.type != "cpu" and target is not None and torch.device(target).type == "cpu" and not kwargs.get("non_blocking")
    if name == "aten::copy_":
        dst, src = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return dst.device.type == "cpu" and src.device.type != "cpu" and not non_blocking
    return False


class OpCounter(TorchDispatchMode):
    """Counts, while active, the calls that reach the dispatcher by namespace, and the host syncs among them.

    Only the outermost calls count: the ops an op runs inside (its decomposition, a fused kernel's
    pieces) are below the mode. Calls of other namespaces (the profiler's ``record_function``
    markers DDP emits) are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()  # namespace -> calls
        self.host_syncs: Counter[str] = Counter()  # op name -> calls

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.calls[func.namespace] += 1
        if is_host_sync(func.name(), args, kwargs):
            self.host_syncs[func.name()] += 1
        return func(*args, **kwargs)

    def counts(self) -> OpCounts:
        return OpCounts(self.calls["aten"], self.calls["c10d"], Counter(self.host_syncs))


def build_method(method: str, config: gpt.GPTConfig, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """(model to call, optimizer) for one method, from the same initial weights; AdamW as the ``step`` suite sets it."""
    model = gpt.build(config, device)
    if method in (BASELINE, "ddp_adamw_foreach"):
        implementation = {"fused": True} if method == BASELINE else {"foreach": True}
        return DDP(model), torch.optim.AdamW(gpt.decay_groups(model), **ADAMW, **implementation)
    stage = {"zeroshard_stage1": 1, "zeroshard_stage2": 2}[method]
    # A process group of its own: ShardedOptimizers sharing one take turns, and each backward would also
    # reduce zeros for the other model's params (zeroshard/reduce/coordinator.py), a cost no single training run pays.
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(gpt.decay_groups(model), **ADAMW, fused=True), stage=stage, process_group=dist.new_group())
    return model, opt


def count_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> OpCounts:
    """The operator calls of one training step in steady state: after ``UNCOUNTED_STEPS`` steps (the first
    builds state and buckets, DDP rebuilds its buckets in the second), the last of which leaves in flight
    what a training step finds (zeroshard's overlapped all-gathers), one step counted whole."""
    for _ in range(UNCOUNTED_STEPS):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    with OpCounter() as counter:
        model(x, y).backward()  # gradient hooks and autograd callbacks run in here
        opt.step()
        opt.zero_grad()
    if isinstance(opt, zeroshard.ShardedOptimizer):
        opt.wait_params()  # nothing left in flight for the next method
    return counter.counts()


def time_forwards(model: nn.Module, opt: zeroshard.ShardedOptimizer, x: torch.Tensor, y: torch.Tensor, rounds: int) -> dict[bool, list[float]]:
    """Seconds of the forward that follows ``step()``, with its gathers in flight (``False``) and after ``wait_params()`` (``True``),
    alternating, each followed by the backward, step and zero_grad that leave the next one's gathers in flight."""
    samples: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(rounds):
        for waited in (False, True) if round_ % 2 == 0 else (True, False):
            if waited:
                opt.wait_params()
            start = time.perf_counter()
            loss = model(x, y)
            if loss.is_cuda:
                torch.cuda.current_stream().synchronize()
            samples[waited].append(time.perf_counter() - start)
            loss.backward()
            opt.step()
            opt.zero_grad()
    opt.wait_params()
    return samples


def rank_main(config: gpt.GPTConfig, rounds: int, steps: int,
              warmup: int) -> tuple[dict[str, OpCounts], dict[str, list[float]], dict[str, dict[bool, list[float]]]]:
    """Each method's counted step, its step times (seconds) from interleaved rounds, and zeroshard's forward times."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    x, y = gpt.batch(config, dist.get_rank(), device)
    built = {m: build_method(m, config, device) for m in METHODS}
    counts = {method: count_step(model, opt, x, y) for method, (model, opt) in built.items()}
    times = time_rounds(built, x, y, rounds, steps, warmup, device)
    forwards = {m: time_forwards(model, opt, x, y, rounds * steps) for m, (model, opt) in built.items() if isinstance(opt, zeroshard.ShardedOptimizer)}
    return counts, times, forwards


def settings(quick: bool) -> list[tuple[str, int, int, int]]:
    """(size, rounds, steps per round, warm-up steps) for each size measured."""
    if quick:  # a smoke run of one timed step per method, at the size that needs no compute
        return [("small-compute", 1, 1, 0)]
    if torch.cuda.is_available():  # steps of 10-25 ms: more of them (12 x 3 gave ratios 0.2 apart run to run on an H100)
        return [("small-compute", 40, 5, 10), ("example", 60, 5, 10)]
    return [("small-compute", 20, 5, 5), ("example", 12, 3, 2)]


def run(quick: bool) -> list[dict]:
    """A row per size and method: its busier rank's op counts, its median step time, and that over the baseline's."""
    rows: list[dict] = []
    world_size = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 2
    for size, rounds, steps, warmup in settings(quick):
        config = SIZES[size]
        progress("overhead", f"counting ops and timing {len(METHODS)} methods at {world_size} rank(s) in fp32, {rounds} rounds x {steps} "
                             f"steps each ({size}: {config})")
        per_rank = run_ranks(rank_main, world_size, config, rounds, steps, warmup)
        timings = {m: Timing(m, tuple(s)) for m, s in per_rank[0][1].items()}
        params = list(gpt.build(config, torch.device("cpu")).parameters())
        for method in METHODS:
            counts = OpCounts.busiest([counts[method] for counts, _, _ in per_rank])
            rows.append({
                "kind": "overhead", "size": size, "world_size": world_size, "model": f"{config.n_layer}x{config.n_embd}", "param_tensors": len(params),
                "params_M": sum(p.numel() for p in params) / 1e6, "batch": f"{config.batch_size}x{config.seq_len}", "method": method,
                "aten_ops": counts.aten, "host_syncs": sum(counts.host_syncs.values()), "c10d_ops": counts.c10d,
                "sync_ops": " ".join(f"{name}={n}" for name, n in sorted(counts.host_syncs.items())),
                "median_ms": timings[method].median * 1e3, "ratio": ratio(timings[method], timings[BASELINE]),
            })
        for method, samples in per_rank[0][2].items():
            pending, waited = Timing(method, tuple(samples[False])), Timing(method, tuple(samples[True]))
            rows.append({"kind": "forward", "size": size, "method": method, "pending_ms": pending.median * 1e3,
                         "none_ms": waited.median * 1e3, "pending_over_none": pending.median / waited.median})
    return rows
