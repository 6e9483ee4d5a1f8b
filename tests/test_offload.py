"""CPU offload (master and Adam state in host memory) and the memory tracer, on gloo ranks.

On a CPU-only machine offload keeps separate host buffers, so the device -> host -> device path runs.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import zeroshard
from models import TinyNet, batch, loss_fn, param_groups, relative_error, tolerance_ratio
from test_parity import _train_pair


def offload_parity_worker(stage: int, accumulation: str, max_grad_norm: float | None) -> float:
    worst = 0.0
    for ref_model, model, _ in _train_pair(stage, accumulation, True, max_grad_norm=max_grad_norm, offload="cpu"):
        worst = max(worst, tolerance_ratio(model, ref_model))
    return worst


@pytest.mark.parametrize("stage, accumulation, max_grad_norm", [(1, "none", None), (2, "none", None), (2, "no_sync", 0.5), (1, "backward", 0.5)])
def test_offload_matches_ddp_adamw(pools, stage, accumulation, max_grad_norm):
    for worst in pools[2].run(offload_parity_worker, stage, accumulation, max_grad_norm):
        assert worst <= 1.0, f"{worst:.3g}x the tolerance (rtol 1e-6, atol 1e-7)"


def on_off_worker(stage: int) -> float:
    """Offload on vs off, fp32, 20 steps, same data."""
    runs = {}
    for offload in (None, "cpu"):
        torch.manual_seed(0)
        model = TinyNet()
        opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), stage=stage, offload=offload)
        for step in range(20):
            loss_fn(model, *batch(dist.get_rank(), step)).backward()
            opt.step()
            model.zero_grad()
        runs[offload] = model
    return tolerance_ratio(runs["cpu"], runs[None])


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_on_and_off_agree(pools, stage):
    assert all(r <= 1.0 for r in pools[2].run(on_off_worker, stage))


def low_precision_offload_worker(dtype: torch.dtype) -> tuple[float, float, float | None]:
    fp32 = list(_train_pair(2, "none", True, torch.float32))[-1][0]
    ddp_bf16 = list(_train_pair(2, "none", True, torch.bfloat16))[-1][0]
    _, sharded, opt = list(_train_pair(2, "none", True, dtype, offload="cpu"))[-1]
    return relative_error(sharded, fp32), relative_error(ddp_bf16, fp32), opt.loss_scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_offload_with_mixed_precision_and_loss_scaling(pools, dtype):
    err, bf16_ddp_err, scale = pools[2].run(low_precision_offload_worker, dtype)[0]
    assert (scale is not None) == (dtype == torch.float16)
    assert err <= 2 * bf16_ddp_err, (err, bf16_ddp_err)


def offload_memory_worker() -> tuple[int, int, int, int]:
    torch.manual_seed(0)
    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), offload="cpu")
    loss_fn(model, *batch(dist.get_rank(), 0)).backward()
    opt.step()
    usage = opt.memory_usage().by_kind
    shard_numel = sum(s.buffer.layout.shard_numel for s in opt._shards)
    return usage["master"], usage["grad_shard"], usage["optimizer_state"], shard_numel


def test_offload_memory_usage_counts_host_buffers(pools):
    for master, grad_shard, state, shard_numel in pools[2].run(offload_memory_worker):
        assert master == 4 * shard_numel  # a separate fp32 master even for fp32 params
        assert grad_shard == 2 * 4 * shard_numel  # the grad shard and its host copy
        assert state >= 8 * shard_numel  # flat exp_avg + exp_avg_sq (+ step counters)


def across_offload_worker(directory: str) -> list[float]:
    """Saved with offload, loaded without (DCP), and back (full dict): training continues alike."""
    def build(offload, seed):
        torch.manual_seed(seed)
        model = TinyNet()
        return model, zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), offload=offload)

    def train(model, opt, steps):
        for step in steps:
            loss_fn(model, *batch(dist.get_rank(), step)).backward()
            opt.step()
            model.zero_grad()

    results = []
    for saver, loader in (("cpu", None), (None, "cpu")):
        model, opt = build(saver, 0)
        train(model, opt, range(3))
        dcp.save({"model": model.state_dict(), "optim": opt}, checkpoint_id=f"{directory}/{saver}")
        resumed, ropt = build(loader, 1)
        state = {"model": resumed.state_dict(), "optim": ropt}
        dcp.load(state, checkpoint_id=f"{directory}/{saver}")
        resumed.load_state_dict(state["model"])
        train(model, opt, range(3, 6))
        train(resumed, ropt, range(3, 6))
        results.append(tolerance_ratio(resumed, model))
    return results


def test_checkpoints_load_across_offload_settings(pools, tmp_path):
    for ratios in pools[2].run(across_offload_worker, str(tmp_path)):
        assert all(r <= 1.0 for r in ratios), ratios


def sgd_offload_worker() -> None:
    with pytest.raises(ValueError, match="offload='cpu' runs torch's fused CPU Adam/AdamW: .* got SGD"):
        zeroshard.ShardedOptimizer(torch.optim.SGD(TinyNet().parameters(), lr=0.1), offload="cpu")
    with pytest.raises(ValueError, match="offload='gpu' must be None or 'cpu'"):
        zeroshard.ShardedOptimizer(torch.optim.AdamW(TinyNet().parameters()), offload="gpu")


def test_offload_refuses_other_optimizers(pools):
    pools[2].run(sgd_offload_worker)


def test_memory_tracer_sees_what_the_region_allocates():
    size = 256 * 2**20
    with zeroshard.MemoryTracer(device="cpu") as tracer:
        block = torch.ones(size // 4)  # touched, so resident
        time.sleep(0.05)
        del block
    grown = tracer.device_peak_bytes - tracer.device_baseline_bytes
    assert 0.9 * size <= grown <= 1.5 * size, grown
    assert tracer.device_capacity_bytes > size
    assert tracer.non_model_peak_bytes(model_data_bytes=tracer.device_peak_bytes) == 0
    assert "peak" in tracer.summary(model_data_bytes=0)
    with pytest.raises(ValueError, match="sample_interval_s=0"):
        zeroshard.MemoryTracer(sample_interval_s=0)
