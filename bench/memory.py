"""``memory`` suite: per-rank bytes of params, gradients and optimizer state at world size 2.

DDP + AdamW and zeroshard stages 1 and 2, in fp32 and in bf16 (zeroshard keeps fp32 masters; the
bf16 DDP baseline is plain AdamW on bf16 params), each in freshly spawned ranks after one training
step. Bytes are counted tensor by tensor (``ShardedOptimizer.memory_usage()``; for DDP the params,
their ``.grad`` and the optimizer state), compared with the ZeRO paper's formula for the same Ψ
and N (bench/formulas.py) and with DDP. On CPU the process's RSS growth is shown too; on GPU, the
growth of the caching allocator's allocated bytes. DDP's own bucket buffers (a second copy of the
gradients unless ``gradient_as_bucket_view=True``) are not in the tensor count.

With torchao installed, a second table gives the optimizer state's bytes per param on rank 0 for
``AdamW`` (zeroshard's flat chunks), torchao's ``AdamW8bit`` and ``AdamW4bit`` (whole params per
rank, tensor-subclass moments) at stages 1 and 2, fp32, after one step, against the bytes the same
optimizer keeps for the params rank 0 owns (per quantized tensor: its codes, an fp32 scale per
block and the quantization map; plain fp32 moments for params under torchao's 4096-element
minimum), and against ``AdamW``'s.
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
    Table(("lowbit",), "optimizer state on rank 0 after one step at 2 ranks, fp32: state_bytes_per_param: memory_usage()'s optimizer_state "
                       "over the model's params; formula_bytes_per_param: the bytes the optimizer keeps for the params rank 0 owns (AdamW: "
                       "8 per element of its slices; 8-bit: 2 per element + 8 per block of 256 + 2 KiB of maps per quantized param; 4-bit: "
                       "1 per element + 8 per block of 128 + 128 B of maps; fp32 moments below 4096 elements), over the model's params; "
                       "measured/formula; vs_adamw: state over AdamW's at the same stage"),
)
LOWBIT = ("AdamW", "AdamW8bit", "AdamW4bit")


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
    if importlib.util.find_spec("torchao") is None:
        return rows
    for stage in (2,) if quick else (1, 2):
        adamw = None
        for kind in LOWBIT:
            progress("memory", f"{kind} state, stage {stage}: one training step at 2 ranks")
            row = run_ranks(lowbit_rank_main, 2, config, kind, stage)[0]
            adamw = adamw or row["state_bytes_per_param"]
            rows.append({**row, "vs_adamw": row["state_bytes_per_param"] / adamw})
    return rows


def expected_state_bytes(kind: str, numel: int) -> int:
    """The bytes ``kind`` keeps as ``exp_avg`` and ``exp_avg_sq`` for one whole fp32 param of ``numel`` elements (torchao's rule:
    quantized from 4096 elements when the block size divides them), ``step`` aside."""
    if kind == "AdamW" or numel < 4096:
        return 2 * 4 * numel
    bits, block, qmap = (8, 256, 256) if kind == "AdamW8bit" else (4, 128, 16)
    if numel % block:
        return 2 * 4 * numel
    return 2 * (numel * bits // 8 + 4 * (numel // block) + 4 * qmap)


def lowbit_rank_main(config: gpt.GPTConfig, kind: str, stage: int) -> dict:
    """One step of ``ShardedOptimizer(kind)``; rank 0's optimizer state bytes per param of the model, measured and expected."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = gpt.build(config, device)
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "AdamW":
        inner: torch.optim.Optimizer = torch.optim.AdamW(params, lr=1e-3)
    else:
        import torchao.optim

        inner = getattr(torchao.optim, kind)(params, lr=1e-3)
    opt = zeroshard.ShardedOptimizer(inner, stage=stage)
    model(*gpt.batch(config, dist.get_rank(), device)).backward()
    opt.step()
    # the state steps (0-dim fp32) are not moments
    state = opt.memory_usage().by_kind["optimizer_state"] - 4 * sum(1 for s in inner.state.values() if "step" in s)
    if kind == "AdamW":  # flat: each rank's slices, 8 bytes per element (padding included)
        expected = 8 * sum(chunk.numel for shard in opt._shards for chunk in shard.chunks)
    else:  # whole params: the ones this rank owns
        expected = sum(expected_state_bytes(kind, vparam.numel()) for shard in opt._shards for vparam in shard.virtual_params)
    numel = sum(p.numel() for p in params)
    return {"kind": "lowbit", "optimizer": kind, "stage": stage, "params_M": numel / 1e6, "state_bytes_per_param": state / numel,
            "formula_bytes_per_param": expected / numel, "measured/formula": state / expected}
