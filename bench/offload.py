"""``offload`` suite: the CPU-offloaded optimizer step against torch's CPU ``AdamW(fused=True)``.

One rank. ``ShardedOptimizer(AdamW, offload="cpu").step()`` on shards of N fp32 elements, timed
alone after a backward that reduced the gradients (as in training) — global norm, grad copy to the
host, torch's fused CPU AdamW on the flat shard, param copy back, gradient buffers zeroed —
against ``torch.optim.AdamW(fused=True).step()`` on one N-element tensor, and the same
ShardedOptimizer without offload. Figures: elements updated per second, and the ratio to torch's
fused AdamW (goal >= 1.0). On a CPU-only machine the "device" is the host too, so the copies are
memcpys; the GPU comparison (offloaded vs on-device step) needs a GPU run.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

import zeroshard
from bench.harness import Timing, ratio, run_ranks


def _time(prepare: Callable[[], None], fn: Callable[[], None], repeats: int) -> Timing:
    """Median etc. of ``fn`` alone; ``prepare`` (untimed) runs before each call and once to warm up."""
    prepare()
    fn()  # warm-up: allocates state
    samples = []
    for _ in range(repeats):
        prepare()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return Timing("", tuple(samples))


def rank_main(numel: int, repeats: int) -> dict[str, Timing]:
    grads = torch.randn(numel)
    timings = {}
    for name, offload in (("zeroshard_offload", "cpu"), ("zeroshard_on_device", None)):
        params = [nn.Parameter(torch.randn(numel // 4)) for _ in range(4)]  # a few params, like a model
        opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(params, lr=1e-3), offload=offload)

        def backward(params=params) -> None:  # gradients arrive through autograd: reduced in backward, as in training
            sum((p * grads[i * p.numel() : (i + 1) * p.numel()]).sum() for i, p in enumerate(params)).backward()

        timings[name] = _time(backward, opt.step, repeats)
    param = nn.Parameter(torch.randn(numel))
    fused = torch.optim.AdamW([param], lr=1e-3, fused=True)

    def set_grad() -> None:
        param.grad = grads.clone()

    timings["torch_adamw_fused"] = _time(set_grad, fused.step, repeats)
    return timings


def run(quick: bool, log: Callable[[str], None] = print) -> list[dict]:
    """Rows per shard size: elements/s per method, then ratios to torch's fused CPU AdamW."""
    sizes = [2**20] if quick else [2**20, 2**22, 2**24]
    log(f"offload: optimizer step on shards of {sizes} fp32 elements, 1 rank")
    rows = []
    for numel in sizes:
        timings = run_ranks(rank_main, 1, numel, 5 if quick else 10)[0]
        for name, t in timings.items():
            rows.append({"kind": "time", "elements": numel, "method": name, "baseline": "", "median_ms": t.median * 1e3,
                         "elements_per_s": numel / t.median, "ratio": ""})
        for name in ("zeroshard_offload", "zeroshard_on_device"):
            rows.append({"kind": "ratio", "elements": numel, "method": name, "baseline": "torch_adamw_fused", "median_ms": "",
                         "elements_per_s": numel / timings[name].median, "ratio": ratio(timings["torch_adamw_fused"], timings[name])})
    return rows
