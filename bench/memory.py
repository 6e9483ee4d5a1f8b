"""``memory`` suite: per-rank bytes of params, gradients and optimizer state at world size 2.

DDP + AdamW and zeroshard stages 1 and 2, in fp32 and in bf16 (zeroshard keeps fp32 masters; the
bf16 DDP baseline is plain AdamW on bf16 params), each in freshly spawned ranks after one training
step. Bytes are counted tensor by tensor (``ShardedOptimizer.memory_usage()``; for DDP the params,
their ``.grad`` and the optimizer state), compared with the ZeRO paper's formula for the same Ψ
and N (bench/formulas.py) and with DDP. On CPU the process's RSS growth is shown too; on GPU, the
growth of the caching allocator's allocated bytes. DDP's own bucket buffers (a second copy of the
gradients unless ``gradient_as_bucket_view=True``) are not in the tensor count.
"""

from __future__ import annotations

import psutil
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard
from bench import gpt
from bench.formulas import zero_bytes
from bench.harness import Table, progress, run_ranks

METHODS = (("ddp", 0), ("zeroshard_stage1", 1), ("zeroshard_stage2", 2))
SUMMARY = "per-rank bytes of params, grads, optimizer state vs DDP and the ZeRO formula"
TABLES = (
    Table((), "MiB on rank 0 after one training step, counted tensor by tensor; formula_MiB: the ZeRO paper's count; measured/formula: "
              "measured over it; vs_ddp: measured over DDP's in the same dtype; process_growth_MiB: RSS growth (GPU: allocated bytes), "
              "activations included"),
)


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _warm_up(config: gpt.GPTConfig, device: torch.device) -> None:
    model = DDP(gpt.build(gpt.GPTConfig(1, 32, 2, config.seq_len, config.batch_size), device))
    model(*gpt.batch(config, dist.get_rank(), device)).backward()
    del model


def rank_main(config: gpt.GPTConfig, method: str, stage: int, dtype: torch.dtype) -> dict:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    _warm_up(config, device)  # lazy initialization (autograd, gloo buffers) out of the growth figure
    rss_before = psutil.Process().memory_info().rss
    allocated_before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    model = gpt.build(config, device).to(dtype)
    numel = sum(p.numel() for p in model.parameters())
    x, y = gpt.batch(config, dist.get_rank(), device)
    if stage == 0:
        opt = torch.optim.AdamW(gpt.decay_groups(model), lr=1e-3)
        DDP(model)(x, y).backward()
        opt.step()
        kinds = {
            "params": _tensor_bytes(model.parameters()),
            "grads": _tensor_bytes(p.grad for p in model.parameters() if p.grad is not None),
            "grad_shard": 0,
            "master": 0,
            "optimizer_state": _tensor_bytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)),
        }
    else:
        opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(gpt.decay_groups(model), lr=1e-3), stage=stage)
        model(x, y).backward()
        opt.step()
        kinds = dict(opt.memory_usage().by_kind)
    if device.type == "cuda":
        torch.cuda.synchronize()
    measured = sum(kinds.values())
    formula = zero_bytes(numel, dist.get_world_size(), stage, mixed_precision=dtype != torch.float32)
    return {
        "method": method, "dtype": str(dtype).replace("torch.", ""), "params_M": numel / 1e6,
        **{f"{k}_MiB": v / 2**20 for k, v in kinds.items()},
        "measured_MiB": measured / 2**20, "formula_MiB": formula / 2**20, "measured/formula": measured / formula,
        "process_growth_MiB": (
            (torch.cuda.memory_allocated() - allocated_before) if device.type == "cuda" else (psutil.Process().memory_info().rss - rss_before)
        ) / 2**20,
    }


def run(quick: bool) -> list[dict]:
    """One row per (method, dtype), rank 0's bytes, with ``vs_ddp`` = measured / DDP's measured."""
    config = gpt.QUICK if quick else (gpt.FULL_GPU if torch.cuda.is_available() else gpt.FULL_CPU)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        ddp = None
        for method, stage in METHODS:
            progress("memory", f"{method}, {str(dtype).replace('torch.', '')}: one training step at 2 ranks")
            row = run_ranks(rank_main, 2, config, method, stage, dtype)[0]
            ddp = ddp or row["measured_MiB"]
            rows.append({**row, "vs_ddp": row["measured_MiB"] / ddp})
    return rows
