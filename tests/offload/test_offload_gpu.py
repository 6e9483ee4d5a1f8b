"""CPU offload on CUDA: pinned host buffers, the copy streams, and placement by the measured margin.

One rank on one GPU (an NCCL group of one, in this process), against torch's own AdamW on the
same model. Skipped without CUDA; run with ``python -m pytest -m gpu``.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from models import TinyNet, batch, loss_fn, param_groups, relative_error, tolerance_ratio

import zeroshard
from zeroshard.layout.chunk import chunks_of
from zeroshard.offload.placement import MarginMeasurement, chunk_device_bytes

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
    injected = contextlib.nullcontext()
    if keep is not None:
        sizes = [chunk_device_bytes(chunk) for chunk in chunks_of(opt._shards)]
        injected = mock.patch("zeroshard.offload.placement.measure_margin", return_value=MarginMeasurement(sum(sizes[:keep]), 0, 0, 0))
    with injected:
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
        on_device = list(opt.placement.on_device) if ratio > 0 else [False] * len(chunks)
        expected = [i < keep for i in range(len(chunks))] if keep is not None else [ratio > 0] * len(chunks)
        assert on_device == expected  # ratio 1.0 measured on a GPU with gigabytes free: everything
        for chunk, here in zip(chunks, on_device):
            assert chunk.exp_avg.device.type == chunk.exp_avg_sq.device.type == ("cuda" if here else "cpu")
            assert here or chunk.master.is_pinned()  # fp32: the master is the DMA source
            assert here or chunk.host_grad.is_pinned()
            assert here or not chunk.exp_avg.is_pinned()  # the moments never leave the host
            assert (chunk.master is None) == here and (chunk.host_grad is None) == here


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


def test_cuda_fp64_with_fused_adamw_matches_torch(nccl_group):
    # fp64 skips the Triton kernel for torch's functional AdamW with the user's fused=True, whose
    # CUDA kernel reads the step counts on the GPU: zeroshard must hand them over there, in fp32.
    models = []
    for sharded in (False, True):
        torch.manual_seed(0)
        model = TinyNet().to("cuda", torch.float64)
        opt = torch.optim.AdamW(param_groups(model), lr=1e-2, fused=True)
        opt = zeroshard.ShardedOptimizer(opt, bucket_size_mb=BUCKET_MB) if sharded else opt
        for step in range(5):
            x, y = (t.cuda() for t in batch(0, step))
            loss_fn(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        models.append(model)
    assert tolerance_ratio(models[1], models[0], rtol=1e-12, atol=1e-14) <= 1.0
