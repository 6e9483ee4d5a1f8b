"""The update of one step once the gradients are reduced: unscale and clip, then fused or wrapped step.

See [Note: zeroshard buffers] in ``zeroshard/flat_buffer.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zeroshard.fused_adam import FusedAdam, chunks_of
from zeroshard.local_shard import LocalShard


def grad_multiplier(norm: float, loss_scale: float, max_norm: float | None) -> float:
    """What the reduced gradients are multiplied by: ``1 / loss_scale`` times the clip coefficient.

    ``norm`` is the global norm of the still-scaled gradients; the clip coefficient is
    ``min(1, max_norm / (norm / loss_scale + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``.
    """
    coefficient = 1.0 if max_norm is None else min(1.0, max_norm / (norm / loss_scale + 1e-6))
    return coefficient / loss_scale


@torch.no_grad()
def apply_update(
    optimizer: torch.optim.Optimizer,
    shards: list[LocalShard],
    fused: FusedAdam | None,
    group_of_shard: list[int],
    used: list[list[bool]],
    steps: list[list[int]],
    multiplier: float,
    chunk_done: Callable[[int, int], None],
) -> None:
    """Update every used piece of every shard and cast 16-bit masters into the flat param buffers.

    Adam/AdamW (``fused``) take one kernel pass per run with the multiplier folded in; any other
    optimizer gets the multiplier applied to the grad shards and its own ``step()`` on the
    virtual params, whose ``.grad`` is ``None`` for params unused on every rank. ``steps``: per
    shard, per param, its step number after this update (0 where unused), for the fused path.

    ``chunk_done(k, b)`` is called once per chunk (shard ``k``, bucket ``b``), in layout order on
    every rank, as soon as this rank's slice of the bucket holds its final params (on CUDA: once
    the current stream is ordered after them), so the caller can launch the bucket's all-gather
    while later chunks are still being updated.
    """
    for shard in shards:
        shard.refresh_master()
    if fused is not None:
        fused.step(shards, group_of_shard, steps, multiplier, chunk_done)
        return
    for shard, flags in zip(shards, used):
        if multiplier != 1.0:
            shard.grad_shard.mul_(multiplier)
        shard.attach_grads(flags)
    optimizer.step()
    for shard in shards:
        shard.detach_grads()
        shard.write_back()
    for k, b in chunks_of(shards):
        chunk_done(k, b)
