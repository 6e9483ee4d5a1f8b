"""``memory`` suite: per-rank bytes of params, gradients and optimizer state at world size 2.

DDP + AdamW and zeroshard stages 1 and 2, in fp32 and in bf16 (zeroshard keeps fp32 masters; the
bf16 DDP baseline is plain AdamW on bf16 params), each in freshly spawned ranks after one training
step. Bytes are counted tensor by tensor (``ShardedOptimizer.memory_usage()``; for DDP the params,
their ``.grad`` and the optimizer state), compared with the ZeRO paper's formula for the same Ψ
and N (bench/formulas.py) and with DDP. On CPU the process's RSS growth is shown too; on GPU, the
growth of the caching allocator's allocated bytes. DDP's own bucket buffers (a second copy of the
gradients unless ``gradient_as_bucket_view=True``) are not in the tensor count.

A second table gives the optimizer state's bytes per param per rank at stages 1 and 2, after one
step: ``AdamW`` on fp32 params (zeroshard's flat chunks), ``AdamW`` on bf16 params with
``master_weights=False`` (bf16 moments, no fp32 master), and with torchao installed its ``AdamW8bit``
and ``AdamW4bit`` (whole params per rank, tensor-subclass moments), each against
``zeroshard.estimate_memory`` for the same model and options, for the rank that keeps the most.
"""

from __future__ import annotations

import importlib.util

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
    Table(("memory",), "MiB on rank 0 after one training step, counted tensor by tensor; formula_MiB: the ZeRO paper's count; "
                       "measured/formula: measured over it; vs_ddp: measured over DDP's in the same dtype; process_growth_MiB: RSS growth "
                       "(GPU: allocated bytes), activations included"),
    Table(("lowbit",), "bytes per param of the model on the rank that keeps the most, after one step at 2 ranks: state_bytes_per_param: "
                       "memory_usage()'s optimizer_state (step tensors included); formula_bytes_per_param: zeroshard.estimate_memory's "
                       "(AdamW: 8 per element of the rank's slices, 4 with bf16 moments; torchao 8-bit: 2 per element + 8 per block of 256 + "
                       "2 KiB of maps per quantized param; 4-bit: 1 per element + 8 per block of 128 + 128 B of maps; plain moments below "
                       "4096 elements); measured/formula; total_bytes_per_param: every kind (params, grads, grad shard, master, state) and "
                       "its formula; vs_adamw: state over fp32 AdamW's at the same stage"),
)
# (optimizer class, param dtype, master_weights): fp32 AdamW, bf16 moments without fp32 masters, torchao's 8-bit and 4-bit
LOWBIT = (("AdamW", torch.float32, True), ("AdamW", torch.bfloat16, False), ("AdamW8bit", torch.float32, True),
          ("AdamW4bit", torch.float32, True))


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
        "kind": "memory", "method": method, "dtype": str(dtype).replace("torch.", ""), "params_M": numel / 1e6,
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
    states = [case for case in LOWBIT if case[0] == "AdamW" or importlib.util.find_spec("torchao") is not None]
    for stage in (2,) if quick else (1, 2):
        adamw = None
        for optimizer_class, dtype, master_weights in states:
            progress("memory", f"{optimizer_class} state ({dtype}, master_weights={master_weights}), stage {stage}: one training step at 2 ranks")
            ranks = run_ranks(lowbit_rank_main, 2, config, optimizer_class, dtype, master_weights, stage)
            row = max(ranks, key=lambda r: r["state_bytes_per_param"])  # the rank that keeps the most, as estimate_memory gives
            adamw = adamw or row["state_bytes_per_param"]
            rows.append({**row, "vs_adamw": row["state_bytes_per_param"] / adamw})
    return rows


def lowbit_rank_main(config: gpt.GPTConfig, optimizer_class: str, dtype: torch.dtype, master_weights: bool, stage: int) -> dict:
    """One step of ``ShardedOptimizer(optimizer_class)``; this rank's bytes per param of the model, and ``estimate_memory``'s."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = gpt.build(config, device).to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer_class == "AdamW":
        inner: torch.optim.Optimizer = torch.optim.AdamW(params, lr=1e-3)
    else:
        import torchao.optim

        inner = getattr(torchao.optim, optimizer_class)(params, lr=1e-3)
    opt = zeroshard.ShardedOptimizer(inner, stage=stage, master_weights=master_weights)
    model(*gpt.batch(config, dist.get_rank(), device)).backward()
    opt.step()
    measured = opt.memory_usage().by_kind
    formula = zeroshard.estimate_memory(model, stage=stage, world_size=dist.get_world_size(), master_weights=master_weights,
                                        optimizer_class=optimizer_class, device_type=device.type).by_kind
    numel = sum(p.numel() for p in params)
    return {"kind": "lowbit", "optimizer": optimizer_class, "dtype": str(dtype).replace("torch.", ""), "master_weights": master_weights,
            "stage": stage, "params_M": numel / 1e6, "state_bytes_per_param": measured["optimizer_state"] / numel,
            "formula_bytes_per_param": formula["optimizer_state"] / numel,
            "measured/formula": measured["optimizer_state"] / formula["optimizer_state"],
            "total_bytes_per_param": sum(measured.values()) / numel, "formula_total_bytes_per_param": sum(formula.values()) / numel}
