"""``kernel`` suite: the fused Adam/AdamW step on one flat shard, against torch and a copy.

GPU: the Triton kernel (bf16 gradient in, fp32 master/moments, bf16 param out, loss-scale x clip
multiplier and overflow flag as device scalars) against ``torch.optim.AdamW(fused=True)`` on the
fp32 master, against the unfused chain (unscale, ``clip_grad_norm_``, ``AdamW(fused=True)``, cast
to bf16) and against a device-to-device copy of as many bytes. Times from
``triton.testing.do_bench`` (median, 20th/80th percentiles).

CPU: the eager reference path zeroshard runs on CPU shards against torch's CPU
``AdamW(fused=True)`` and ``AdamW(foreach=True)`` on one tensor of the same size, and a memcpy of
as many bytes. Times from ``torch.utils.benchmark.Timer``.

Bytes per element of the fused step (GB/s = bytes x elements / time):
read param, exp_avg, exp_avg_sq (4 each) + grad (2 bf16 on GPU, 4 fp32 on CPU);
write param, exp_avg, exp_avg_sq (4 each) + param_out (2 bf16, GPU only).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.utils.benchmark as benchmark

from bench.harness import RATIO_LEGEND, Table, Timing, progress, ratio
from zeroshard.kernels import adamw_reference_, fused_adamw_

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
GPU_BYTES_PER_ELEMENT = 4 * 3 + 2 + 4 * 3 + 2
CPU_BYTES_PER_ELEMENT = 4 * 3 + 4 + 4 * 3
SUMMARY = "the fused AdamW step on one flat shard vs torch's AdamW and a memory copy"
TABLES = (
    Table(("time", "ratio"), "median_us, p20_us, p80_us: one step; GB_per_s: bytes the step moves (bench/kernel.py) / median time, "
                             f"on ratio rows zeroshard's; {RATIO_LEGEND}"),
)


def _torch_adamw(n: int, device: str, **flags) -> tuple[torch.optim.AdamW, torch.nn.Parameter]:
    param = torch.nn.Parameter(torch.randn(n, device=device))
    param.grad = torch.randn(n, device=device)
    opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.1, **flags)
    opt.step()  # creates the state
    return opt, param


def _cpu_rows(sizes: list[int], min_run_time: float) -> list[dict]:
    rows = []
    for n in sizes:
        progress("kernel", f"{n:,} elements on CPU: zeroshard's reference step, torch AdamW fused and foreach, memcpy")
        param, grad, exp_avg, exp_avg_sq = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
        fused, _ = _torch_adamw(n, "cpu", fused=True)
        foreach, _ = _torch_adamw(n, "cpu", foreach=True)
        copy_bytes = CPU_BYTES_PER_ELEMENT * n // 2  # read + write of this many bytes moves the step's total
        src, dst = torch.empty(copy_bytes, dtype=torch.uint8), torch.empty(copy_bytes, dtype=torch.uint8)
        cases: dict[str, Callable[[], None]] = {
            "zeroshard_reference": lambda: adamw_reference_(param, grad, exp_avg, exp_avg_sq, step=10, **HYPER),
            "torch_adamw_fused": fused.step,
            "torch_adamw_foreach": foreach.step,
            "memcpy": lambda: dst.copy_(src),
        }
        timings = {}
        for name, fn in cases.items():
            measured = benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time)
            timings[name] = Timing(name, tuple(measured.times))
        rows += _rows(n, timings, CPU_BYTES_PER_ELEMENT, "zeroshard_reference", ["torch_adamw_fused", "torch_adamw_foreach", "memcpy"])
    return rows


def _gpu_rows(sizes: list[int]) -> list[dict]:
    import triton.testing

    rows = []
    for n in sizes:
        progress("kernel", f"{n:,} elements on {torch.cuda.get_device_name()}: zeroshard's Triton step, torch AdamW fused, "
                           "the unfused chain, a device copy")
        master, exp_avg, exp_avg_sq = (torch.randn(n, device="cuda") for _ in range(3))
        exp_avg_sq.abs_()
        grad = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        scale, found = torch.full((1,), 0.5, device="cuda"), torch.zeros(1, device="cuda")
        fused, fused_param = _torch_adamw(n, "cuda", fused=True)
        src = torch.empty(GPU_BYTES_PER_ELEMENT * n // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)

        def chain() -> None:  # what a torch loop runs: unscale, clip, AdamW(fused=True), cast
            fused_param.grad = grad.float().mul_(scale)
            torch.nn.utils.clip_grad_norm_([fused_param], 1.0)
            fused.step()
            out.copy_(fused_param.detach())

        cases = {
            "zeroshard_triton": lambda: fused_adamw_(master, grad, exp_avg, exp_avg_sq, step=10, grad_scale=scale, found_inf=found, param_out=out, **HYPER),
            "torch_adamw_fused": fused.step,
            "unfused_chain": chain,
            "device_copy": lambda: dst.copy_(src),
        }
        timings = {}
        for name, fn in cases.items():
            q20, median, q80 = triton.testing.do_bench(fn, warmup=25, rep=200, quantiles=[0.2, 0.5, 0.8])
            timings[name] = Timing(name, (q20 / 1e3, median / 1e3, q80 / 1e3))
        rows += _rows(n, timings, GPU_BYTES_PER_ELEMENT, "zeroshard_triton", ["torch_adamw_fused", "unfused_chain", "device_copy"])
    return rows


def _rows(n: int, timings: dict[str, Timing], bytes_per_element: int, subject: str, baselines: list[str]) -> list[dict]:
    gbps = bytes_per_element * n / timings[subject].median / 1e9
    rows = [{"kind": "time", "elements": n, "method": m, "baseline": "", "median_us": t.median * 1e6, "p20_us": t.p20 * 1e6,
             "p80_us": t.p80 * 1e6, "GB_per_s": bytes_per_element * n / t.median / 1e9, "ratio": ""} for m, t in timings.items()]
    for base in baselines:
        rows.append({"kind": "ratio", "elements": n, "method": subject, "baseline": base, "median_us": "", "p20_us": "", "p80_us": "",
                     "GB_per_s": gbps, "ratio": ratio(timings[subject], timings[base])})
    return rows


def run(quick: bool) -> list[dict]:
    """Rows per shard size: each method's time and GB/s, then ``ratio`` = zeroshard time / baseline time (< 1: zeroshard faster)."""
    if torch.cuda.is_available():
        return _gpu_rows([2**20, 2**24] if quick else [2**20, 2**22, 2**24, 2**26, 2**28])
    return _cpu_rows([2**20] if quick else [2**20, 2**22, 2**24], min_run_time=0.2 if quick else 1.0)
