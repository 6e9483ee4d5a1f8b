"""``MemoryUsage``: the bytes a :class:`~zeroshard.ShardedOptimizer` owns, by kind and place."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class MemoryUsage:
    """Bytes owned by the optimizer on this rank.

    Attributes:
        device_bytes: bytes on the params' device (on a CPU-only run, that device is the CPU).
        host_bytes: bytes in host memory when the params live on an accelerator (e.g. the
            wrapped optimizer's CPU ``step`` counters); 0 on a CPU-only run.
        by_kind: bytes per kind wherever they live: ``"params"`` (flat param buffers),
            ``"grads"`` (stage 1 flat grad buffers, stage 2 staging buckets in flight),
            ``"grad_shard"`` (with offload, its host copy too), ``"master"`` (fp32 copies for
            16-bit params, or every master weight with offload) and
            ``"optimizer_state"`` (the wrapped optimizer's state, e.g. ``exp_avg``,
            ``exp_avg_sq``, ``step``).
    """

    device_bytes: int
    host_bytes: int
    by_kind: dict[str, int] = field(default_factory=dict)


def measure(tensors_by_kind: dict[str, list[Tensor]], device: torch.device) -> MemoryUsage:
    """Count the bytes (``numel * element_size``) of each kind's tensors, on ``device`` and elsewhere.

    Views are counted at their own size; callers pass each owned storage once.
    """
    on_device = elsewhere = 0
    by_kind = {}
    for kind, tensors in tensors_by_kind.items():
        by_kind[kind] = 0
        for t in tensors:
            size = t.numel() * t.element_size()
            by_kind[kind] += size
            if t.device == device:
                on_device += size
            else:
                elsewhere += size
    return MemoryUsage(on_device, elsewhere, by_kind)
