"""Host time of each phase of a training step: ``python -m bench.host_phases`` (not a suite; no CSV).

A GPU runs kernels asynchronously, so the host time of the forward, ``backward()``, ``step()`` and
``zero_grad()`` is what a step costs when kernels are short (#27). For each size of the
``overhead`` suite and for DDP + ``AdamW(fused=True)`` and zeroshard stages 1 and 2 (built as that
suite builds them): 10 warm-up steps each, then 60 steps each timed phase by phase with the host
clock and no sync, the methods taking turns in ``--rounds`` rounds (each ending in one
synchronization, for the wall time per step). One rank (NCCL on a GPU, gloo on CPU), fp32; under
``torchrun --nproc-per-node N`` every rank runs it and rank 0 prints its own times (at 2 gloo ranks
on CPU the collectives' waits show where the ranks meet: the end of DDP's backward, zeroshard's
``step()`` and the forward after it). With ``--profile``, zeroshard stage 2 at the small-compute size runs 20 more steps
under ``cProfile`` and prints the 40 functions with the most time of their own; with ``--profile-step``,
stages 1 and 2 at the example size run ``--steps`` more steps with only ``opt.step()`` profiled (30 functions).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

import torch
import torch.distributed as dist

import zeroshard
from bench import overhead

METHODS = ("ddp_adamw_fused", "zeroshard_stage1", "zeroshard_stage2")
PHASES = ("forward", "backward", "step", "zero_grad")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def phase_times(model, opt, x: torch.Tensor, device: torch.device, steps: int = 60, warmup: int = 10) -> tuple[float, dict[str, float]]:
    """(wall seconds per step, host seconds per step of each phase) over ``steps`` steps after ``warmup``."""
    for _ in range(warmup):
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
    _sync(device)
    if dist.get_world_size() > 1:
        dist.barrier()  # every rank starts the timed steps together
    totals = dict.fromkeys(PHASES, 0.0)
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = model(x, x)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        opt.zero_grad()
        t4 = time.perf_counter()
        for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            totals[phase] += seconds
    _sync(device)
    return (time.perf_counter() - start) / steps, {phase: seconds / steps for phase, seconds in totals.items()}


def init_ranks(port: str) -> torch.device:
    """Under torchrun (``WORLD_SIZE`` > 1): join its process group (NCCL on GPU ``LOCAL_RANK``, else gloo); otherwise
    :func:`init_one_rank`. This rank's device."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return init_one_rank(port)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def init_one_rank(port: str) -> torch.device:
    """Start a process group of this process alone (NCCL on GPU 0, else gloo; ``MASTER_PORT`` defaults to ``port``); its device."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", port)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def profile_steps(model, opt, x: torch.Tensor, steps: int) -> cProfile.Profile:
    """``steps`` training steps with only ``opt.step()`` under cProfile (forward, backward and ``zero_grad`` outside it)."""
    profiler = cProfile.Profile()
    for _ in range(steps):
        model(x, x).backward()
        profiler.enable()
        opt.step()
        profiler.disable()
        opt.zero_grad()
    return profiler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", action="store_true", help="cProfile zeroshard stage 2 at the small-compute size")
    parser.add_argument("--profile-step", action="store_true", help="cProfile only opt.step() of zeroshard stages 1 and 2 at the example size")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per method")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before them")
    parser.add_argument("--rounds", type=int, default=3, help="turns each method takes, its timed steps split evenly between them")
    args = parser.parse_args(argv)
    device = init_ranks("29533")
    shown = dist.get_rank() == 0
    try:
        for size, config in overhead.SIZES.items():
            x = torch.randint(0, 256, (config.batch_size, config.seq_len), generator=torch.Generator().manual_seed(dist.get_rank()))
            x = x.to(device)
            built = {method: overhead.build_method(method, config, device) for method in METHODS}
            times = {method: [0.0, dict.fromkeys(PHASES, 0.0)] for method in METHODS}
            per_round = max(1, args.steps // args.rounds)
            for round_ in range(args.rounds):  # the methods take turns, the order reversed every other round
                for method in METHODS if round_ % 2 == 0 else METHODS[::-1]:
                    model, opt = built[method]
                    wall, host = phase_times(model, opt, x, device, per_round, args.warmup if round_ == 0 else 1)
                    if isinstance(opt, zeroshard.ShardedOptimizer):
                        opt.wait_params()  # nothing in flight into the next method's turn
                    times[method][0] += wall / args.rounds
                    for phase, seconds in host.items():
                        times[method][1][phase] += seconds / args.rounds
            for method in METHODS if shown else ():
                wall, host = times[method]
                print(f"{size:14s} {method:18s} wall {wall * 1e3:7.3f} ms/step; host ms: "
                      + ", ".join(f"{phase} {seconds * 1e3:.3f}" for phase, seconds in host.items()), flush=True)
            for method in METHODS:
                model, opt = built[method]
                if args.profile and size == "small-compute" and method == "zeroshard_stage2":
                    profiler = cProfile.Profile()
                    profiler.enable()
                    phase_times(model, opt, x, device, steps=20, warmup=0)
                    profiler.disable()
                    if shown:
                        pstats.Stats(profiler).sort_stats("tottime").print_stats(40)
                if args.profile_step and size == "example" and method != "ddp_adamw_fused":
                    profiler = profile_steps(model, opt, x, args.steps)
                    if shown:
                        print(f"{size} {method}: opt.step() under cProfile, {args.steps} steps", flush=True)
                        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
