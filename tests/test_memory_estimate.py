"""``zeroshard.estimate_memory`` against ``opt.memory_usage()`` measured after one step."""

from __future__ import annotations

import pytest
import torch
from models import TinyNet, batch, loss_fn
from torch import nn

import zeroshard

# (model, stage, dtype, offload, bucket_size_mb): odd shapes, tied and frozen params (TinyNet), several
# buckets with padding (an MLP with 0.002 MiB buckets), one big param, both stages, fp32 and bf16, offload.
CASES = [
    ("tiny", 1, torch.float32, None, 25.0),
    ("tiny", 2, torch.float32, None, 25.0),
    ("tiny", 2, torch.bfloat16, None, 25.0),
    ("tiny", 2, torch.float32, "cpu", 25.0),
    ("tiny", 1, torch.bfloat16, "cpu", 25.0),
    ("mlp", 2, torch.bfloat16, None, 0.002),
    ("mlp", 1, torch.float32, None, 0.002),
    ("one", 2, torch.float32, None, 25.0),
]


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(17, 31), nn.GELU(), nn.Linear(31, 23), nn.GELU(), nn.Linear(23, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _model(name: str, dtype: torch.dtype) -> tuple[nn.Module, int | nn.Module, object]:
    """(model, what estimate_memory gets, a function of the model giving a loss)."""
    torch.manual_seed(0)
    if name == "tiny":
        model = TinyNet().to(dtype)
        return model, model, lambda m: loss_fn(m, *batch(torch.distributed.get_rank(), 0))
    if name == "mlp":
        model = _MLP().to(dtype)
        return model, model, lambda m: m(torch.randn(4, 17, dtype=dtype)).float().square().mean()
    model = nn.Linear(1001, 1, bias=False).to(dtype)  # one param, given as an int
    return model, 1001, lambda m: m(torch.randn(4, 1001, dtype=dtype)).float().square().mean()


def estimate_worker(cases: list, shard_size: int | None) -> list[tuple[dict, dict, int, int, int, int]]:
    world_size = torch.distributed.get_world_size()
    process_group = None if shard_size is None else zeroshard.hybrid_mesh(shard_size)
    results = []
    for name, stage, dtype, offload, bucket_size_mb in cases:
        model, subject, loss = _model(name, dtype)
        opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), stage=stage, offload=offload,
                                         bucket_size_mb=bucket_size_mb, process_group=process_group)
        loss(model).backward()
        opt.step()
        measured = opt.memory_usage()
        estimate = zeroshard.estimate_memory(subject, stage=stage, world_size=world_size, dtype=dtype, offload=offload,
                                             shard_size=shard_size, bucket_size_mb=bucket_size_mb, device_type="cpu")
        results.append((measured.by_kind, estimate.by_kind, measured.device_bytes, estimate.device_bytes, measured.host_bytes, estimate.host_bytes))
        opt.close()
    return results


def _check(results) -> None:
    for rank_results in results:
        for case, (measured, estimate, device, device_estimate, host, host_estimate) in zip(CASES, rank_results):
            assert measured.keys() == estimate.keys()
            for kind, value in measured.items():
                assert abs(estimate[kind] - value) <= 0.05 * value, (case, kind, estimate[kind], value)
            assert abs(device_estimate - device) <= 0.05 * device and host == host_estimate == 0, case


def test_estimate_within_5_percent_of_measured(pools):
    _check(pools[2].run(estimate_worker, CASES, None))


def test_estimate_within_5_percent_of_measured_hybrid(pools):
    _check(pools[4].run(estimate_worker, CASES[:3], 2))


# (stage, dtype, optimizer class, master_weights): torchao's low-bit state (whole params per rank; the weights
# quantized, the biases under torchao's 4096-element minimum kept plain), bf16 moments without fp32 masters.
STATE_CASES = [
    (1, torch.float32, "AdamW8bit", True),
    (2, torch.float32, "AdamW8bit", True),
    (2, torch.float32, "AdamW4bit", True),
    (2, torch.float32, "AdamWFp8", True),
    (2, torch.bfloat16, "AdamW8bit", True),
    (1, torch.bfloat16, "AdamW", False),
    (2, torch.bfloat16, "AdamW", False),
    (2, torch.bfloat16, "_AdamW", False),
]


def state_worker(cases: list) -> list[tuple[dict, dict]]:
    results = []
    for stage, dtype, optimizer_class, master_weights in cases:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 8)).to(dtype)
        if optimizer_class == "AdamW":
            inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        else:
            import torchao.optim

            inner = getattr(torchao.optim, optimizer_class)(model.parameters(), lr=1e-3)
        opt = zeroshard.ShardedOptimizer(inner, stage=stage, master_weights=master_weights)
        model(torch.randn(4, 64, dtype=dtype)).float().square().mean().backward()
        opt.step()
        estimate = zeroshard.estimate_memory(model, stage=stage, world_size=torch.distributed.get_world_size(), master_weights=master_weights,
                                             optimizer_class=optimizer_class, device_type="cpu")
        results.append((opt.memory_usage().by_kind, estimate.by_kind))
        opt.close()
    return results


def test_estimate_counts_low_bit_state_and_bf16_moments(pools):
    """The estimate gives the rank that keeps the most (with whole params per rank, the ranks differ), to the byte."""
    pytest.importorskip("torchao.optim")
    results = pools[2].run(state_worker, STATE_CASES)
    for i, case in enumerate(STATE_CASES):
        estimate = results[0][i][1]
        assert results[1][i][1] == estimate
        for kind, value in estimate.items():
            measured = max(rank_results[i][0][kind] for rank_results in results)
            assert value == measured, (case, kind, value, measured)
    low_bit = {case[2]: results[0][i][1]["optimizer_state"] for i, case in enumerate(STATE_CASES) if case[:2] == (2, torch.float32)}
    assert low_bit["AdamW4bit"] < low_bit["AdamWFp8"] < low_bit["AdamW8bit"]  # fp8 has no quantization map


def test_estimate_on_cuda_puts_offloaded_state_on_the_host():
    on_device = zeroshard.estimate_memory(10**6, stage=2, world_size=4, dtype=torch.bfloat16)
    offloaded = zeroshard.estimate_memory(10**6, stage=2, world_size=4, dtype=torch.bfloat16, offload="cpu")
    # ZeRO stage 2, mixed precision: 2Ψ params + (4 grad shard + 4 master + 8 moments)Ψ/N, plus 4 bytes of step.
    assert on_device.device_bytes + on_device.host_bytes == 2 * 10**6 + 16 * 10**6 // 4 + 4
    # Offloaded: master, moments, the gradient's host copy and the pinned param staging move to the host.
    assert offloaded.host_bytes == (4 + 8 + 4 + 2) * 10**6 // 4 + 4
    assert offloaded.device_bytes == 2 * 10**6 + 4 * 10**6 // 4


@pytest.mark.parametrize("kwargs", [dict(stage=3), dict(world_size=0), dict(shard_size=3), dict(offload="nvme"), dict(dtype=torch.int8),
                                    dict(optimizer_class="SGD"), dict(block_size=0), dict(offload="cpu", optimizer_class="AdamW8bit"),
                                    # accepted before (a bool as an int, a bucket the optimizer refuses), or an error from int():
                                    dict(world_size=True), dict(bucket_size_mb=0), dict(bucket_size_mb=-1),
                                    dict(bucket_size_mb=float("nan")), dict(device_type="tpu"),
                                    dict(model_or_numel=3.7), dict(model_or_numel=[1, 2])])
def test_estimate_refuses_bad_arguments(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        zeroshard.estimate_memory(**{"model_or_numel": 1000, "world_size": 4, **kwargs})


# The type named, as the optimizer does:
@pytest.mark.parametrize("kwargs", [dict(dtype="bf16"), dict(stage=True), dict(bucket_size_mb="25"), dict(offload=True)])
def test_estimate_refuses_arguments_of_another_type(kwargs):
    with pytest.raises(TypeError, match=next(iter(kwargs))):
        zeroshard.estimate_memory(1000, **{"world_size": 4, **kwargs})
