"""Where offloaded optimizer state lives: the measured GPU margin and the chunk placement.

With ``offload="cpu"`` every chunk (this rank's slice of one bucket: master, ``exp_avg``,
``exp_avg_sq``) starts in host memory. ``gpu_margin_mem_ratio`` > 0 keeps part of it on the device,
as PatrickStar (Fang et al., 2021, §5) and ColossalAI's ``ShardedOptimizerV2`` do:

1. a :class:`~zeroshard.MemoryTracer` runs from the optimizer's construction to the first
   ``step()``, the first training iteration, and measures its peak device memory;
2. the margin is what that iteration leaves unused: device capacity − peak non-model memory
   (activations, temporaries) − model data (params, gradients, grad shards) − a fragmentation
   headroom of :data:`FRAGMENTATION_HEADROOM` of the capacity;
3. ``ratio × margin`` bytes of chunks move to the device, whole chunks, first fit in layout order
   (:func:`plan_placement`); they take the fused device kernel from then on, the rest the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zeroshard.fused_adam import FusedAdam, chunk_state_bytes, chunks_of
from zeroshard.local_shard import LocalShard
from zeroshard.memory_tracer import MemoryTracer

FRAGMENTATION_HEADROOM = 0.05  # fraction of the device capacity left free for the allocator's fragmentation


@dataclass(frozen=True)
class MarginMeasurement:
    """What the first iteration left free on the device (bytes).

    Attributes:
        capacity_bytes: memory this process can use on the device (CUDA: free + already reserved
            by torch's caching allocator; CPU-only: available + this process's RSS).
        non_model_peak_bytes: peak memory not taken by model data (activations, temporaries).
        model_data_bytes: params, gradient buffers, grad shards, masters and state on the device.
        headroom_bytes: left free for fragmentation.
    """

    capacity_bytes: int
    non_model_peak_bytes: int
    model_data_bytes: int
    headroom_bytes: int

    @property
    def margin_bytes(self) -> int:
        """``capacity − non-model peak − model data − headroom``, at least 0."""
        return max(0, self.capacity_bytes - self.non_model_peak_bytes - self.model_data_bytes - self.headroom_bytes)


def measure_margin(tracer: MemoryTracer, model_data_bytes: int, headroom: float = FRAGMENTATION_HEADROOM) -> MarginMeasurement:
    """The margin from a finished ``tracer`` and the model data on the device now (bytes)."""
    capacity = tracer.device_available_bytes
    return MarginMeasurement(capacity, tracer.non_model_peak_bytes(model_data_bytes), model_data_bytes, int(headroom * capacity))


def plan_placement(chunk_bytes: Sequence[int], margin_bytes: int, ratio: float) -> list[bool]:
    """Which chunks stay on the device: first fit, in order, within ``ratio × margin_bytes``.

    Args:
        chunk_bytes: device bytes each chunk would take there (see
            :func:`~zeroshard.fused_adam.chunk_state_bytes`).
        margin_bytes: the measured margin (:attr:`MarginMeasurement.margin_bytes`).
        ratio: ``gpu_margin_mem_ratio``, 0.0 (everything on the host) to 1.0 (the whole margin).

    Returns:
        One flag per chunk, ``True`` for the device. A chunk larger than what is left of the
        budget stays on the host (a later, smaller one may still fit); the chosen chunks never
        sum to more than ``ratio × margin_bytes``.

    Raises:
        ValueError: ``ratio`` outside [0, 1] or a negative size.
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"gpu_margin_mem_ratio={ratio!r} must be between 0.0 and 1.0")
    if margin_bytes < 0 or any(size < 0 for size in chunk_bytes):
        raise ValueError(f"plan_placement: sizes must be >= 0, got margin {margin_bytes} and chunks {list(chunk_bytes)[:8]}")
    budget = int(ratio * margin_bytes)
    plan = []
    for size in chunk_bytes:
        fits = size <= budget
        budget -= size if fits else 0
        plan.append(fits)
    return plan


def place_chunks(shards: list[LocalShard], fused: FusedAdam, measurement: MarginMeasurement, ratio: float, device: torch.device) -> str:
    """Plan the placement of every chunk of ``shards`` and move the chosen ones to the device.

    Returns the log line (:func:`describe_placement`), which also says when the device ran out
    of memory before every planned chunk had moved (those stay on the host; nothing fails).
    """
    chunks = chunks_of(shards)
    sizes = [chunk_state_bytes(shards[k], b) for k, b in chunks]
    plan = plan_placement(sizes, measurement.margin_bytes, ratio)
    moved = set(fused.place_on_device(shards, [c for c, keep in zip(chunks, plan) if keep]))
    line = describe_placement(measurement, ratio, sizes, [c in moved for c in chunks], device)
    return line if len(moved) == sum(plan) else f"{line} (the device ran out of memory after {len(moved)} of the {sum(plan)} planned)"


def describe_placement(measurement: MarginMeasurement, ratio: float, chunk_bytes: Sequence[int], on_device: Sequence[bool], device: torch.device) -> str:
    """The one log line of a placement: the margin's terms, and the chunks (count, MiB) on each side."""
    mib = 2**20
    kept = sum(size for size, keep in zip(chunk_bytes, on_device) if keep)
    return (
        f"zeroshard: gpu_margin_mem_ratio={ratio} of a {measurement.margin_bytes / mib:,.0f} MiB margin "
        f"(capacity {measurement.capacity_bytes / mib:,.0f} - non-model peak {measurement.non_model_peak_bytes / mib:,.0f} "
        f"- model data {measurement.model_data_bytes / mib:,.0f} - headroom {measurement.headroom_bytes / mib:,.0f} MiB): "
        f"{sum(on_device)} of {len(chunk_bytes)} chunks ({kept / mib:,.1f} MiB of optimizer state) on {device}, "
        f"{len(chunk_bytes) - sum(on_device)} ({(sum(chunk_bytes) - kept) / mib:,.1f} MiB) in host memory"
    )
