"""Stage 2's staging buckets: where a backward's gradients wait for their bucket's reduce-scatter.

See [Note: zeroshard buffers] in ``zeroshard/layout/flat_buffer.py`` for buckets and slots.

Each bucket being filled gets a 1-D staging buffer in the reduce dtype, ``padded_numel`` elements, taken from a pool of
free ones (or allocated) without zeroing. A param's gradient is *copied* into its slot the first time (one read and one
write, where zero-filling and adding took two passes more); a second one for the same slot before the launch is added.
At the launch only what no gradient wrote is zeroed: the slots of params without a gradient on this rank and the
padding. After the reduce-scatter the buffer goes back to the pool; :meth:`StagingBuckets.clear` drops them all (no
gradient memory is held between steps).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from zeroshard.layout.partition import FlatLayout


@dataclass
class _Staged:
    data: Tensor  # 1D reduce dtype, the bucket's padded_numel elements
    written: set[int] = field(default_factory=set)  # indices of the params whose gradient is in ``data``


@functools.lru_cache(maxsize=1024)
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (in elements)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class StagingBuckets:
    """The staging buffers of one gradient reducer's buckets, keyed by (shard, bucket)."""

    def __init__(self) -> None:
        self._open: dict[tuple[int, int], _Staged] = {}
        self._pool: dict[tuple[int, torch.dtype], list[Tensor]] = {}  # (numel, dtype) -> free buffers, until clear()

    def add(self, key: tuple[int, int], layout: FlatLayout, index: int, grad: Tensor, dtype: torch.dtype) -> None:
        """Put param ``index``'s gradient (any shape, ``slot.numel`` elements) into its slot of bucket ``key`` (shard, bucket), cast to ``dtype``."""
        slot = layout.slots[index]
        bucket = layout.buckets[slot.bucket]
        staged = self._open.get(key)
        if staged is None:
            free = self._pool.get((bucket.padded_numel, dtype))
            staged = self._open[key] = _Staged(free.pop() if free else torch.empty(bucket.padded_numel, dtype=dtype, device=grad.device))
        start = slot.offset - bucket.offset
        # The slot shaped like the gradient, in one operator (a slice and a view would be two per param and backward).
        target = staged.data.as_strided(grad.shape, contiguous_strides(grad.shape), staged.data.storage_offset() + start)
        if index in staged.written:
            target.add_(grad)
        else:
            target.copy_(grad)
            staged.written.add(index)

    def pop(self, key: tuple[int, int], layout: FlatLayout) -> Tensor | None:
        """The filled staging buffer of bucket ``key``, every element no gradient wrote set to zero; ``None`` if none arrived."""
        staged = self._open.pop(key, None)
        if staged is None:
            return None
        bucket = layout.buckets[key[1]]
        end = 0  # the first element not yet accounted for
        for slot in sorted((layout.slots[i] for i in bucket.params), key=lambda s: s.offset):
            if slot.index in staged.written:
                start = slot.offset - bucket.offset
                if start > end:
                    staged.data[end:start].zero_()  # padding, or the slots of params without a gradient, before this one
                end = start + slot.numel
        if end < staged.data.numel():
            staged.data[end:].zero_()
        return staged.data

    def recycle(self, data: Tensor) -> None:
        """Return a staging buffer whose reduce-scatter has completed to the pool."""
        self._pool.setdefault((data.numel(), data.dtype), []).append(data)

    def clear(self) -> None:
        """Forget every open and pooled buffer (between steps, or after a backward that raised)."""
        self._open.clear()
        self._pool.clear()

    def buffers(self) -> list[Tensor]:
        """Every buffer held now, open or pooled (not those in flight: the caller holds them)."""
        return [s.data for s in self._open.values()] + [t for free in self._pool.values() for t in free]
