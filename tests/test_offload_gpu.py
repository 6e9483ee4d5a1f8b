"""CPU offload on CUDA: pinned host buffers, the copy streams, and placement by the measured margin.

One rank on one GPU (an NCCL group of one, in this process), against torch's own AdamW on the
same model. Skipped without CUDA; run with ``python -m pytest -m gpu``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zeroshard
from models import TinyNet, batch, loss_fn, param_groups, relative_error, tolerance_ratio
from zeroshard.fused_adam import chunk_state_bytes, chunks_of
from zeroshard.offload import MarginMeasurement

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS = 20
BUCKET_MB = 200 * 4 / 2**20  # several chunks for the tiny model


@pytest.fixture
def nccl_group(tmp_path):
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _train(dtype: torch.dtype, offload: str | None, ratio: float = 0.0, keep: int | None = None, reference: bool = False):
    """20 steps of TinyNet on CUDA; ``reference``: with plain ``torch.optim.AdamW(fused=True)``;
    ``keep``: inject a first-iteration margin worth the first ``keep`` chunks."""
    torch.manual_seed(0)
    model = TinyNet().to("cuda", dtype)
    if reference:
        opt = torch.optim.AdamW(param_groups(model), lr=1e-2, fused=True)
    else:
        opt = zeroshard.ShardedOptimizer(
            torch.optim.AdamW(param_groups(model), lr=1e-2), bucket_size_mb=BUCKET_MB, offload=offload, gpu_margin_mem_ratio=ratio,
        )
        if keep is not None:
            sizes = [chunk_state_bytes(opt._shards[k], b) for k, b in chunks_of(opt._shards)]
            opt._measure_margin = lambda tracer: MarginMeasurement(sum(sizes[:keep]), 0, 0, 0)
    for step in range(STEPS):
        x, y = (t.cuda() for t in batch(0, step))
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    return model, opt


@pytest.mark.parametrize("offload, ratio, keep", [("cpu", 0.0, None), ("cpu", 1.0, 2), ("cpu", 1.0, None), (None, 0.0, None)])
def test_cuda_offload_matches_torch_adamw(nccl_group, offload, ratio, keep):
    reference, _ = _train(torch.float32, None, reference=True)
    model, opt = _train(torch.float32, offload, ratio, keep)
    assert tolerance_ratio(model, reference, rtol=1e-5, atol=1e-6) <= 1.0
    chunks = chunks_of(opt._shards)
    if offload:
        on_device = [c in opt._fused.on_device for c in chunks]
        expected = [i < keep for i in range(len(chunks))] if keep is not None else [ratio > 0] * len(chunks)
        assert on_device == expected  # ratio 1.0 measured on a GPU with gigabytes free: everything
        for (k, b), here in zip(chunks, on_device):
            assert opt._fused.exp_avg[(k, b)].device.type == ("cuda" if here else "cpu")
            assert here or opt._shards[k].master_slice(b).is_pinned()  # fp32: the master is the DMA source
            assert here or opt._fused.host_grad[(k, b)].is_pinned()


def test_cuda_offload_bf16_and_memory_usage(nccl_group):
    fp32, _ = _train(torch.float32, None, reference=True)
    bf16_ref, _ = _train(torch.bfloat16, None)
    model, opt = _train(torch.bfloat16, "cpu")
    assert relative_error(model, fp32) <= 2 * relative_error(bf16_ref, fp32)
    usage = opt.memory_usage()
    shard = sum(s.buffer.layout.shard_numel for s in opt._shards)
    # In host memory: fp32 master, exp_avg, exp_avg_sq, the gradient copy, the bf16 staging.
    assert usage.host_bytes >= (4 + 8 + 4 + 2) * shard
    assert usage.by_kind["master"] == 4 * shard
    assert usage.device_bytes < usage.host_bytes
