"""Stage 2's staging buckets: where a backward's gradients meet for their bucket's reduce-scatter.

See [Note: zeroshard buffers] in ``zeroshard/layout/flat_buffer.py`` for buckets and slots.

A bucket's gradients are held as autograd made them until the bucket launches (FSDP2 holds a module's the same way), then
written into a 1-D staging buffer in the reduce dtype, ``padded_numel`` elements, taken from a pool of free ones (or
allocated) without zeroing: one ``torch.cat`` per run of adjacent slots, where a copy per param cost two operators per
param and backward. A second gradient for the same slot before the launch is added (in the reduce dtype, as a copy then
an ``add_``). Only what no gradient wrote is zeroed: the slots of params without a gradient on this rank and the padding.
A gradient that is a slice of a larger tensor (``torch.cat``'s backward hands out such slices) is copied on arrival
instead: held, it would keep all of that tensor alive. Holding the gradients costs at most one bucket of memory. After
the reduce-scatter the buffer goes back to the pool; :meth:`StagingBuckets.clear` drops them all (no gradient memory is
held between steps).
"""

from __future__ import annotations

import torch
from torch import Tensor

from zeroshard.layout.partition import FlatLayout


class StagingBuckets:
    """The staging buffers of one gradient reducer's buckets, keyed by (shard, bucket)."""

    def __init__(self) -> None:
        self._open: dict[tuple[int, int], dict[int, Tensor]] = {}  # per open bucket: param index -> its gradient
        self._dtypes: dict[tuple[int, int], torch.dtype] = {}  # per open bucket: the reduce dtype
        self._pool: dict[tuple[int, torch.dtype], list[Tensor]] = {}  # (numel, dtype) -> free buffers, until clear()

    def add(self, key: tuple[int, int], index: int, grad: Tensor, dtype: torch.dtype) -> None:
        """Hold param ``index``'s gradient (any shape, its slot's numel elements) for bucket ``key`` (shard, bucket), to be cast to ``dtype``."""
        if grad.requires_grad:  # backward(create_graph=True): the reduction carries values only, as DDP's does
            grad = grad.detach()
        if grad.untyped_storage().nbytes() > grad.numel() * grad.element_size():  # a slice of a larger gradient (cat's backward)
            grad = grad.clone()  # held, it would keep all of that alive until the launch
        held = self._open.get(key)
        if held is None:
            held = self._open[key] = {}
            self._dtypes[key] = dtype
        if index in held:  # a second gradient before the launch: summed as the staging buffer would have summed it
            held[index] = held[index].to(dtype, copy=True).add_(grad)
        else:
            held[index] = grad

    def pop(self, key: tuple[int, int], layout: FlatLayout) -> Tensor | None:
        """The staging buffer of bucket ``key``: every held gradient in its slot, every other element zero; ``None`` if none arrived."""
        held = self._open.pop(key, None)
        if held is None:
            return None
        dtype = self._dtypes.pop(key)
        bucket = layout.buckets[key[1]]
        free = self._pool.get((bucket.padded_numel, dtype))
        data = free.pop() if free else torch.empty(bucket.padded_numel, dtype=dtype, device=next(iter(held.values())).device)
        runs: list[tuple[int, list[Tensor]]] = []  # (first element, the gradients written back to back from it)
        end = 0  # the first element not yet accounted for
        for index in bucket.params:  # in flat order
            grad = held.get(index)
            if grad is None:
                continue
            start = layout.slots[index].offset - bucket.offset
            if start > end:
                data[end:start].zero_()  # padding, or the slots of params without a gradient, before this one
            if start > end or not runs:
                runs.append((start, []))
            runs[-1][1].append(grad.reshape(-1))
            end = start + layout.slots[index].numel
        if end < data.numel():
            data[end:].zero_()
        for start, grads in runs:
            torch.cat(grads, out=data[start : start + sum(g.numel() for g in grads)])
        return data

    def recycle(self, data: Tensor) -> None:
        """Return a staging buffer whose reduce-scatter has completed to the pool."""
        self._pool.setdefault((data.numel(), data.dtype), []).append(data)

    def clear(self) -> None:
        """Forget every held gradient and pooled buffer (between steps, or after a backward that raised)."""
        self._open.clear()
        self._dtypes.clear()
        self._pool.clear()

    def buffers(self) -> list[Tensor]:
        """Every tensor held now: the gradients of open buckets and the pooled buffers (not those in flight: the caller holds them)."""
        return [g for held in self._open.values() for g in held.values()] + [t for free in self._pool.values() for t in free]
