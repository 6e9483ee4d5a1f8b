"""``offload`` suite: the CPU-offloaded optimizer step against torch's CPU ``AdamW(fused=True)``.

One rank, shards of N fp32 elements in 4 params. Each subject's step is timed alone, after a
backward that produced its gradients (as in training):

* ``zeroshard_offload``: the whole ``ShardedOptimizer(AdamW, offload="cpu").step()`` — global norm,
  gradient copy to the host, torch's fused CPU AdamW chunk by chunk, params copied back, gradient
  buffers zeroed. On a CPU-only machine the "device" is the host, so the two copies are memcpys
  the CPU does itself (on a GPU machine they are DMA transfers overlapped with the update).
* ``zeroshard_offload_cpu_adam``: the CPU update alone within that step — the sum of the
  ``zeroshard.offload.cpu_adam`` profiler ranges, each around one chunk's call of torch's fused
  kernel — which is the CPU's share of an offloaded step.
* ``zeroshard_on_device``: the same ShardedOptimizer without offload.
* ``torch_adamw_fused`` (the baseline): ``torch.optim.AdamW(fused=True).step()`` on one N-element
  tensor, whose gradient comes from a backward of the same form; ``torch_adamw_fused_profiled``:
  the same step under the profiler, the baseline of the CPU update (both sides pay the
  profiler's per-op cost). The baseline's range is its whole ``step()``, bookkeeping included;
  zeroshard's bookkeeping (step counts, state views, runs) precedes its ranges.

The subjects take turns, one step each per round, the order rotated every round, so each sees
the same machine (load from other processes, clock) and the same cache: the other subjects' work
runs between two of its steps, as a forward and backward do in training. Fairness fixes of
2026-11-22:

* each subject used to run all its steps back to back, the baseline after a bare gradient clone:
  at 2^20 its 16 MiB of state stayed in the 32 MiB L3 cache from one step to the next, while
  zeroshard's ran behind a backward and the copies (alone, the baseline step was 1.3-2x faster
  there than after other work); and on a loaded machine whichever phase ran while it was quiet won;
* zeroshard's step() leaves the guard of its in-flight all-gathers (a TorchFunctionMode, see
  ``zeroshard/gather/param_gather.py``) on the mode stack until a module or zeroshard call pops it, so
  the baseline's steps, run after zeroshard's, paid its Python call on every torch function
  (~65 µs a step); each zeroshard subject now waits for its all-gathers after its step (untimed).

One difference remains, and it favours zeroshard slightly: on a CPU-only machine the CPU itself
copies each chunk's gradient to the host buffer just before the chunk's update, so the update
reads it from cache (~2% at the default 25 MiB buckets; a GPU's DMA would leave it in memory).

Figures: elements updated per second and the ratio subject time / baseline time (goal for the CPU
update: <= 1.0).

The suite also times whole training steps of the example GPT (bf16 params, one rank; on CUDA a
compute-bound batch) without offload, with full offload (``gpu_margin_mem_ratio=0``) and with
half of the optimizer state's chunks kept on the GPU (a margin injected to hold exactly that, as
the tracer would measure on a fuller GPU). Ratios: full offload / no offload (goal <= 1.2) and
half / max(GPU part, CPU part) (goal <= 1.1), where the GPU part is the no-offload step and the
CPU part the half run's CPU update (profiler ranges). On a CPU-only machine the "GPU" is the host
too, so these figures only show the cost of the extra copies.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple
from unittest import mock

import torch
from torch import nn

import zeroshard
from bench import gpt
from bench.harness import RATIO_LEGEND, Table, Timing, progress, ratio, run_ranks
from zeroshard.layout.chunk import chunks_of
from zeroshard.offload.pipeline import CPU_ADAM_RANGE
from zeroshard.offload.placement import MarginMeasurement, chunk_device_bytes

STEP_RANGE = "bench.offload.step"
SUMMARY = "the CPU-offloaded step vs torch's fused CPU AdamW; training steps offloaded"
TABLES = (
    Table(("time", "ratio"), "median_ms: one whole step() after a backward, except *_cpu_adam and *_profiled: only the CPU AdamW "
                             f"update (profiler ranges), not the copies, grad norm or all-gather; {RATIO_LEGEND}"),
    Table(("train_time", "train_ratio"), "median_ms: one training step of the example GPT in bf16; *_cpu_adam: that run's CPU update alone "
                                         f"(profiler ranges); {RATIO_LEGEND}; goals: offload <= 1.2, offload_half <= 1.1"),
)
# The lines kineto (torch.profiler's backend) writes to stderr as a profile starts and stops:
# "USDT:2026-11-22 07:21:23 2785:2785 SyncActivityProfilerHandler.cpp:52] profiler_start".
PROFILER_NOISE = re.compile(rb"(USDT|STAGE):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+:\d+\] ")


@contextlib.contextmanager
def without_profiler_noise() -> Iterator[None]:
    """Run the body with file descriptor 2 captured, then write back all of it but kineto's notices."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            os.write(2, b"".join(line for line in captured.readlines() if not PROFILER_NOISE.match(line)))


class Subject(NamedTuple):
    """One timed thing: ``step`` is timed; ``prepare`` runs untimed before each step, ``after`` untimed after it."""

    prepare: Callable[[], None]
    step: Callable[[], None]
    after: Callable[[], None] = lambda: None


def _rounds(subjects: dict[str, Subject], repeats: int) -> Iterator[tuple[str, Subject]]:
    """``repeats`` rounds of every subject once, the order rotated by one each round."""
    names = list(subjects)
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            yield name, subjects[name]


def _time(subjects: dict[str, Subject], repeats: int) -> dict[str, Timing]:
    """Per subject, the times of its step alone, the subjects taking turns (see :func:`_rounds`); one warm-up round first (allocates state)."""
    samples: dict[str, list[float]] = {name: [] for name in subjects}
    for warm, (name, subject) in enumerate(_rounds(subjects, repeats + 1)):
        subject.prepare()
        start = time.perf_counter()
        subject.step()
        elapsed = time.perf_counter() - start
        subject.after()
        if warm >= len(subjects):
            samples[name].append(elapsed)
    return {name: Timing("", tuple(times)) for name, times in samples.items()}


def _profiled(subjects: dict[str, Subject], repeats: int, inner: dict[str, str | None]) -> dict[str, Timing]:
    """Per subject, per call of its step, the summed duration of the profiler ranges named ``inner[name]`` within it (``None``: the whole step).

    The subjects take turns (see :func:`_rounds`) in one pass under ``torch.profiler``, whose
    instrumentation of every op costs time: compare only with figures measured the same way."""
    with without_profiler_noise(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for name, subject in _rounds(subjects, repeats):
            subject.prepare()
            with torch.profiler.record_function(f"{STEP_RANGE}:{name}"):
                subject.step()
            subject.after()
    events = prof.events()
    timings = {}
    for name in subjects:
        outer = [e.time_range for e in events if e.name == f"{STEP_RANGE}:{name}"]
        ranges = [e.time_range for e in events if e.name == inner[name]] if inner[name] else outer
        timings[name] = Timing("", tuple(sum(r.elapsed_us() for r in ranges if s.start <= r.start <= s.end) * 1e-6 for s in outer))
    return timings


def rank_main(numel: int, repeats: int) -> dict[str, Timing]:
    grads = torch.randn(numel)
    subjects: dict[str, Subject] = {}
    for name, offload in (("zeroshard_offload", "cpu"), ("zeroshard_on_device", None)):
        params = [nn.Parameter(torch.randn(numel // 4)) for _ in range(4)]  # a few params, like a model
        opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(params, lr=1e-3), offload=offload)

        def backward(params=params) -> None:  # gradients arrive through autograd: reduced in backward, as in training
            sum((p * grads[i * p.numel() : (i + 1) * p.numel()]).sum() for i, p in enumerate(params)).backward()

        # step() leaves its all-gathers in flight behind a TorchFunctionMode that every torch call
        # passes through until a module or zeroshard call finds them done (zeroshard/gather/param_gather.py);
        # wait_params() after each step, as the next forward would, keeps it off the others' steps.
        subjects[name] = Subject(backward, opt.step, opt.wait_params)
    param = nn.Parameter(torch.randn(numel))
    fused = torch.optim.AdamW([param], lr=1e-3, fused=True)

    def fused_backward() -> None:  # the same backward; a fresh gradient, as zero_grad() (set_to_none) leaves it
        param.grad = None
        (param * grads).sum().backward()

    subjects["torch_adamw_fused"] = Subject(fused_backward, fused.step)
    timed = _time(subjects, repeats)
    profiled = _profiled({name: subjects[name] for name in ("zeroshard_offload", "torch_adamw_fused")}, repeats,
                         {"zeroshard_offload": CPU_ADAM_RANGE, "torch_adamw_fused": None})
    return {"zeroshard_offload": timed["zeroshard_offload"], "zeroshard_offload_cpu_adam": profiled["zeroshard_offload"],
            "zeroshard_on_device": timed["zeroshard_on_device"], "torch_adamw_fused": timed["torch_adamw_fused"],
            "torch_adamw_fused_profiled": profiled["torch_adamw_fused"]}


GPU_METHODS = {"on_device": (None, None), "offload": ("cpu", None), "offload_half": ("cpu", 0.5)}  # (offload, share of chunk bytes on the GPU)


def training_rank_main(config: gpt.GPTConfig, steps: int) -> dict[str, Timing]:
    """Step times of the example GPT in bf16 per method, and the half-offloaded run's CPU update."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    x, y = gpt.batch(config, 0, device)
    timings = {}
    for name, (offload, share) in GPU_METHODS.items():
        model = gpt.build(config, device).to(torch.bfloat16)
        opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(gpt.decay_groups(model), lr=1e-4), offload=offload,
                                         gpu_margin_mem_ratio=1.0 if share else 0.0)
        margin = contextlib.nullcontext()
        if share:  # the first step places this share of the chunk bytes on the GPU, whatever the GPU has free
            sizes = [chunk_device_bytes(chunk) for chunk in chunks_of(opt._shards)]
            margin = mock.patch("zeroshard.offload.placement.measure_margin", return_value=MarginMeasurement(int(share * sum(sizes)), 0, 0, 0))

        def train_step(model=model, opt=opt) -> None:
            opt.backward(model(x, y))
            opt.step()
            opt.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        with margin:
            timings[name] = _time({name: Subject(lambda: None, train_step)}, steps)[name]
        if share:
            timings[f"{name}_cpu_adam"] = _profiled({name: Subject(lambda: None, train_step)}, steps, {name: CPU_ADAM_RANGE})[name]
        del model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return timings


def training_rows(quick: bool) -> list[dict]:
    """Rows of the training-step comparison (GPU part and CPU part: see the module docstring)."""
    config = gpt.QUICK if quick else (gpt.FULL_GPU if torch.cuda.is_available() else gpt.FULL_CPU)
    progress("offload", f"training steps without, with full and with half offload, bf16, 1 rank ({config})")
    timings = run_ranks(training_rank_main, 1, config, 2 if quick else 20)[0]
    rows = [{"kind": "train_time", "elements": "", "method": name, "baseline": "", "median_ms": t.median * 1e3, "elements_per_s": "", "ratio": ""}
            for name, t in timings.items()]
    gpu_part, cpu_part = timings["on_device"], timings["offload_half_cpu_adam"]
    rows.append({"kind": "train_ratio", "elements": "", "method": "offload", "baseline": "on_device", "median_ms": "", "elements_per_s": "",
                 "ratio": timings["offload"].median / gpu_part.median})
    slower = gpu_part if gpu_part.median >= cpu_part.median else cpu_part
    rows.append({"kind": "train_ratio", "elements": "", "method": "offload_half", "baseline": "max(on_device, offload_half_cpu_adam)",
                 "median_ms": "", "elements_per_s": "", "ratio": timings["offload_half"].median / slower.median})
    return rows


def run(quick: bool) -> list[dict]:
    """Rows per shard size: elements/s per method, then ratios to torch's fused CPU AdamW; then the training rows."""
    rows = []
    for numel in [2**20] if quick else [2**20, 2**22, 2**24]:
        progress("offload", f"optimizer step on {numel:,} fp32 elements, 1 rank: timed, then the CPU update under the profiler")
        timings = run_ranks(rank_main, 1, numel, 3 if quick else 10)[0]
        for name, t in timings.items():
            rows.append({"kind": "time", "elements": numel, "method": name, "baseline": "", "median_ms": t.median * 1e3,
                         "elements_per_s": numel / t.median, "ratio": ""})
        for name, baseline in (("zeroshard_offload_cpu_adam", "torch_adamw_fused_profiled"), ("zeroshard_offload", "torch_adamw_fused"),
                               ("zeroshard_on_device", "torch_adamw_fused")):
            rows.append({"kind": "ratio", "elements": numel, "method": name, "baseline": baseline, "median_ms": "",
                         "elements_per_s": numel / timings[name].median, "ratio": ratio(timings[name], timings[baseline])})
    return rows + training_rows(quick)
