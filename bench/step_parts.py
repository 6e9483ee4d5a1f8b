"""Host time of ``opt.step()``'s parts, one rank: ``python -m bench.step_parts [SIZE ...]`` (not a suite; no CSV).

cProfile inflates Python-heavy code several times over; this wraps about thirty functions and methods of the step path in
``time.perf_counter`` timers instead (inclusive times, about 1 µs per wrapped call) and prints, for zeroshard stages 1 and 2 at
each size of the ``overhead`` suite named (default: ``example``), the host µs per step of each, after 20 warm-up steps, over
``--steps`` steps of forward, backward, ``step()``, ``zero_grad()``. One rank (NCCL on a GPU, gloo on CPU), or under
``torchrun --nproc-per-node N`` every rank, rank 0 printing its own (a collective's wait then holds the ranks' skew). The wrapped names
are zeroshard's internals: a rename makes this script fail at its start (#27; figures in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import zeroshard.comm.collectives as collectives
import zeroshard.gather.param_gather as param_gather
import zeroshard.layout.local_shard as local_shard
import zeroshard.optimizer as optimizer
import zeroshard.reduce.grad_reducer as grad_reducer
import zeroshard.shard_set as shard_set
import zeroshard.step.fused_adam as fused_adam
import zeroshard.step.grad_norm as grad_norm
import zeroshard.update as update
from bench import overhead
from bench.host_phases import init_ranks

# (owner, attribute): what is timed, where the step path looks it up
TIMED: list[tuple[Any, str]] = [
    (optimizer.ShardedOptimizer, "step"), (optimizer.ShardedOptimizer, "wait_params"), (optimizer, "coordinator_of"),
    (update.UpdateMixin, "_settle"), (update.UpdateMixin, "_gather_stats"), (update.UpdateMixin, "_on_device"),
    (update.UpdateMixin, "_update_on_device"), (update.UpdateMixin, "_update"), (update.UpdateMixin, "_note_scaled_losses"),
    (update, "reduce_grad_stats"), (update, "unscale"), (update, "device_multiplier"), (update, "PendingSkip"),
    (grad_norm, "grad_sumsq"), (grad_norm.ReducedStats, "norm"), (collectives, "all_reduce"), (collectives, "wait"),
    (local_shard.LocalShard, "follow_all"), (local_shard.LocalShard, "refresh_master"), (shard_set.ShardSet, "count_steps"),
    (fused_adam.FusedAdam, "check_state"), (fused_adam.FusedAdam, "bind"), (fused_adam.FusedAdam, "step"),
    (fused_adam, "device_adam"), (fused_adam, "fused_adamw_"), (fused_adam, "takes_device_scalars"),
    (grad_reducer.GradReducer, "reduce_for_step"), (grad_reducer.GradReducer, "drop_unused_grads"),
    (grad_reducer.GradReducer, "reset"), (grad_reducer.GradReducer, "local_used"), (param_gather.ParamGather, "launch"),
]


def timed(function: Callable, label: str, seconds: dict[str, float], calls: collections.Counter) -> Callable:
    """``function`` adding its inclusive host time to ``seconds[label]`` and a call to ``calls[label]``."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            seconds[label] += time.perf_counter() - start
            calls[label] += 1
    return wrapper


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sizes", nargs="*", help=f"overhead suite sizes, of {list(overhead.SIZES)} (default: example)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per method")
    args = parser.parse_args(argv)
    if unknown := [size for size in args.sizes if size not in overhead.SIZES]:
        parser.error(f"unknown sizes {unknown}; choose from {list(overhead.SIZES)}")
    seconds: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    for owner, name in TIMED:
        setattr(owner, name, timed(getattr(owner, name), f"{getattr(owner, '__name__', owner)}.{name}", seconds, calls))
    device = init_ranks("29544")
    try:
        for size in args.sizes or ["example"]:
            config = overhead.SIZES[size]
            x = torch.randint(0, 256, (config.batch_size, config.seq_len), generator=torch.Generator().manual_seed(dist.get_rank())).to(device)
            for method in ("zeroshard_stage1", "zeroshard_stage2"):
                model, opt = overhead.build_method(method, config, device)
                for step in range(20 + args.steps):
                    if step == 20:
                        seconds.clear()
                        calls.clear()
                    model(x, x).backward()
                    opt.step()
                    opt.zero_grad()
                if dist.get_rank() != 0:
                    continue
                print(f"== {size} {method}: inclusive host µs per step (calls per step)", flush=True)
                for label, total in sorted(seconds.items(), key=lambda item: -item[1]):
                    print(f"  {total / args.steps * 1e6:8.1f} µs  ({calls[label] / args.steps:4.1f})  {label}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
