"""Pure index math for flat, bucketed, rank-partitioned parameter storage: plain functions of integers (no
``torch.distributed``), property-tested on their own. The terms are [Note: zeroshard buffers] in ``zeroshard/layout/flat_buffer.py``.

Layout rules (Rajbhandari et al., "ZeRO", SC'20, §5.2 and §5.3): params are laid out one after another in the order given
(reverse registration order, which approximates the order gradients become ready in backward) and cut into buckets of at
most ``bucket_numel`` elements; a param never straddles two buckets. Each bucket is padded to a multiple of ``world_size``.
With ``align``, every param and bucket starts a multiple of ``align`` elements into the buffer (the caller passes 64 bytes'
worth: where torch's allocators put a tensor, so that kernels whose rounding or speed depends on alignment see a param
as they would outside the buffer; Megatron-LM's distributed optimizer pads param starts alike). A bucket's ``numel``
counts the gaps between its params (under ``align`` elements before each), which do not depend on the world size, and
stays within ``bucket_numel`` unless it holds one param.

With ``owners`` (``partition="param"``, for optimizers that need each param whole: issue #14), each param lies whole in its
owner's slice instead (docs/shape_aware.md, "Communication": how a bucket's slices are filled). Every slice is padded to the
fullest one: the slices stay equal, so the same reduce-scatter and all-gather serve both modes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in the flat buffer (offsets in elements)."""

    index: int  # position of the param in the sequence given to build_layout
    offset: int  # first element of the param in the flat buffer
    numel: int
    bucket: int  # index of the bucket holding the param


@dataclass(frozen=True)
class Bucket:
    """A run of whole params, reduced and gathered as one collective (offsets in elements)."""

    index: int  # position of the bucket in the flat buffer
    offset: int  # first element of the bucket in the flat buffer
    numel: int  # flat: from the bucket's start to its last param's end (alignment gaps included); owned: its params' elements
    padded_numel: int  # world size x slice size: numel rounded up to a multiple of it, or with owners every slice padded to the largest
    params: tuple[int, ...]  # indices of the params in the bucket, in layout (flat) order
    shard_offset: int  # first element of this bucket's slice within a rank's shard

    def shard_numel(self, world_size: int) -> int:
        """Elements of this bucket owned by each rank (``padded_numel // world_size``)."""
        return self.padded_numel // world_size

    def rank_range(self, rank: int, world_size: int) -> tuple[int, int]:
        """``[start, end)`` in flat-buffer elements of the slice owned by ``rank``."""
        size = self.shard_numel(world_size)
        start = self.offset + rank * size
        return start, start + size


@dataclass(frozen=True)
class ShardPiece:
    """The intersection of one param with one rank's slice of its bucket (offsets in elements)."""

    param: int  # index of the param (as in ParamSlot.index)
    param_offset: int  # first element of the piece within the flattened param
    numel: int  # > 0
    flat_offset: int  # first element of the piece in the flat buffer
    shard_offset: int  # first element of the piece within the rank's shard


@dataclass(frozen=True)
class FlatLayout:
    """The full layout of one flat buffer for a given world size."""

    slots: tuple[ParamSlot, ...]  # one per param, in the order given
    buckets: tuple[Bucket, ...]  # in flat-buffer order
    world_size: int
    numel: int  # elements of the flat buffer, padding and alignment gaps included
    shard_numel: int  # elements of each rank's shard (its slices of all buckets)
    owners: tuple[int, ...] | None = None  # per param, the rank whose slice holds it whole (partition="param"); None: params may span slices

    @property
    def whole_params(self) -> bool:
        """Whether every param lies whole in one rank's slice (built with ``owners``)."""
        return self.owners is not None

    def within_one_slice(self, index: int) -> bool:
        """Whether param ``index`` lies whole in one rank's slice of its bucket (always, with ``owners``)."""
        slot = self.slots[index]
        bucket = self.buckets[slot.bucket]
        lo, hi = bucket.rank_range((slot.offset - bucket.offset) // bucket.shard_numel(self.world_size), self.world_size)
        return lo <= slot.offset and slot.offset + slot.numel <= hi

    def pieces(self, rank: int) -> list[ShardPiece]:
        """Every non-empty intersection of a param with ``rank``'s slices, in flat order.

        Raises:
            ValueError: if ``rank`` is not in ``[0, world_size)``.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside [0, world_size={self.world_size})")
        pieces = []
        for bucket in self.buckets:
            lo, hi = bucket.rank_range(rank, self.world_size)
            for index in bucket.params:
                slot = self.slots[index]
                start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if start < end:
                    pieces.append(ShardPiece(param=index, param_offset=start - slot.offset, numel=end - start, flat_offset=start,
                                             shard_offset=bucket.shard_offset + (start - lo)))
        return pieces


ALIGN_BYTES = 64  # where a param starts in its flat buffer: as torch's CPU allocator aligns a tensor (the CUDA one, to 512)


def param_align(itemsize: int) -> int:
    """``build_layout``'s ``align`` for params of ``itemsize`` bytes: ``ALIGN_BYTES`` worth of elements."""
    return max(1, ALIGN_BYTES // itemsize)


def bucket_contents(layout: FlatLayout) -> list[tuple[tuple[int, ...], int, list[int]]]:
    """Per bucket, what the sharded checkpoint's bucket entry holds: its params, its ``numel`` and where each param starts in it."""
    return [(b.params, b.numel, [layout.slots[i].offset - b.offset for i in b.params]) for b in layout.buckets]


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` (>= 1) that is >= ``value``."""
    return -(-value // multiple) * multiple


def build_layout(numels: Sequence[int], bucket_numel: int, world_size: int, owners: Sequence[int] | None = None, align: int = 1) -> FlatLayout:
    """Cut params of the given sizes into padded buckets shared by ``world_size`` ranks.

    Args:
        numels: element count of each param, in layout order (each >= 1).
        bucket_numel: soft cap on elements per bucket (>= 1); a larger param gets its own bucket (with ``owners``: its own
            slice, and the bucket's other slices are filled up to its size).
        world_size: number of ranks (>= 1).
        owners: per param, the rank in ``[0, world_size)`` that must hold it whole; ``None`` lays params out flat (see the
            module docstring for both rules).
        align: every param and bucket starts a multiple of this many elements into the buffer (>= 1; with ``owners``, every
            slice too).

    Returns:
        The :class:`FlatLayout`. Without ``owners`` padding is at the end of each bucket (and, with ``align``, before a
        param or bucket that would start unaligned); with them, at the end of each param (with ``align``) and slice.

    Raises:
        ValueError: on an empty ``numels``, a param with fewer than one element, a ``bucket_numel`` / ``world_size`` / ``align``
            below one, or ``owners`` of another length or naming a rank outside ``[0, world_size)``.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel={bucket_numel} must be >= 1")
    if align < 1:
        raise ValueError(f"align={align} must be >= 1")
    if len(numels) == 0:
        raise ValueError("numels is empty: a flat buffer needs at least one param")
    bad = [(i, n) for i, n in enumerate(numels) if n < 1]
    if bad:
        raise ValueError(f"params must have at least one element; got (index, numel) {bad[:5]}")
    if owners is not None:
        return _build_owned_layout(numels, bucket_numel, world_size, owners, align)

    groups: list[list[int]] = []
    extent = 0  # elements from the bucket's start to the end of its last param, gaps included
    for index, numel in enumerate(numels):
        if groups and round_up(extent, align) + numel <= bucket_numel:
            groups[-1].append(index)
            extent = round_up(extent, align) + numel
        else:
            groups.append([index])
            extent = numel

    slots: list[ParamSlot] = []
    buckets: list[Bucket] = []
    offset = shard_offset = 0
    for bucket_index, members in enumerate(groups):
        start = offset
        for index in members:
            offset = round_up(offset, align)
            slots.append(ParamSlot(index, offset, numels[index], bucket_index))
            offset += numels[index]
        used = offset - start
        padded = round_up(used, world_size)  # slices of ceil(used / N): torch.chunk's split, which the sharded checkpoint relies on
        buckets.append(Bucket(bucket_index, start, used, padded, tuple(members), shard_offset))
        offset = round_up(start + padded, align)
        shard_offset += padded // world_size
    return FlatLayout(tuple(slots), tuple(buckets), world_size, offset, shard_offset)


def _fill(queues: list[list[int]], heads: list[int], numels: Sequence[int], limit: int) -> list[list[int]]:
    """Per rank, the next params of its queue that fit in ``limit`` elements together."""
    taken = []
    for rank, queue in enumerate(queues):
        members, filled, head = [], 0, heads[rank]
        while head < len(queue) and filled + numels[queue[head]] <= limit:
            members.append(queue[head])
            filled += numels[queue[head]]
            head += 1
        taken.append(members)
    return taken


def _slice_sizes(queues: list[list[int]], heads: list[int], numels: Sequence[int], limit: int, largest: int) -> list[int]:
    """Slice sizes worth trying for the next bucket: ``limit``, and every size in ``[max(limit / 2, largest), limit)`` at
    which some rank's slice would end exactly (a sum of the next params of its queue); each is tried, the least padding wins."""
    sizes = {limit}
    floor = max(limit // 2, largest)
    for rank, queue in enumerate(queues):
        total = 0
        for index in queue[heads[rank]:]:
            total += numels[index]
            if total > limit:
                break
            if total >= floor:
                sizes.add(total)
    return sorted(sizes, reverse=True)  # the largest first: min() keeps the first of equal waste


def _waste(taken: list[list[int]], numels: Sequence[int]) -> float:
    """The share of a bucket that is padding, if its slices take ``taken``."""
    fills = [sum(numels[i] for i in members) for members in taken]
    return 1.0 - sum(fills) / (len(fills) * max(fills))


def _build_owned_layout(numels: Sequence[int], bucket_numel: int, world_size: int, owners: Sequence[int], align: int) -> FlatLayout:
    """:func:`build_layout` with each param whole in its owner's slice (arguments checked there but ``owners``); slices are
    filled with each param's footprint, its size rounded up to ``align``, so every slice and param starts aligned."""
    if len(owners) != len(numels):
        raise ValueError(f"owners has {len(owners)} entries for {len(numels)} params")
    bad = [(i, r) for i, r in enumerate(owners) if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"owners must be ranks in [0, world_size={world_size}); got (index, owner) {bad[:5]}")
    queues = [[i for i in range(len(numels)) if owners[i] == rank] for rank in range(world_size)]
    heads = [0] * world_size  # next param of each rank's queue
    cap = -(-bucket_numel // world_size)
    footprints = [round_up(n, align) for n in numels]
    slots: dict[int, ParamSlot] = {}
    buckets: list[Bucket] = []
    offset = shard_offset = 0
    while any(head < len(queue) for head, queue in zip(heads, queues)):
        largest = max(footprints[queue[head]] for head, queue in zip(heads, queues) if head < len(queue))
        limit = max(cap, largest)
        taken = min((_fill(queues, heads, footprints, candidate) for candidate in _slice_sizes(queues, heads, footprints, limit, largest)),
                    key=lambda members: _waste(members, footprints))
        for rank, members in enumerate(taken):
            heads[rank] += len(members)
        size = max(sum(footprints[i] for i in members) for members in taken)  # the fullest slice; the others are padded to it
        for rank, members in enumerate(taken):
            start = offset + rank * size
            for index in members:
                slots[index] = ParamSlot(index, start, numels[index], len(buckets))
                start += footprints[index]
        used = sum(numels[i] for members in taken for i in members)
        buckets.append(Bucket(len(buckets), offset, used, size * world_size, tuple(i for members in taken for i in members), shard_offset))
        offset += size * world_size
        shard_offset += size
    return FlatLayout(tuple(slots[i] for i in range(len(numels))), tuple(buckets), world_size, offset, shard_offset, tuple(owners))
