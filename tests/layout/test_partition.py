"""Property tests: flatten -> shard -> all-gather -> unflatten round trips, ownership of every element."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from zeroshard.layout.flat_buffer import FlatParamBuffer
from zeroshard.layout.local_shard import LocalShard
from zeroshard.layout.partition import bucket_contents, build_layout

numels = st.lists(st.integers(1, 300), min_size=1, max_size=12)
aligns = st.sampled_from([1, 2, 16, 32])  # param_align of fp64, and of fp32 / bf16 (16 / 32 elements: 64 bytes)


@settings(max_examples=300, deadline=None)
@given(numels=numels, bucket_numel=st.integers(1, 700), world_size=st.integers(1, 8), align=aligns)
def test_every_element_owned_by_exactly_one_rank(numels, bucket_numel, world_size, align):
    layout = build_layout(numels, bucket_numel, world_size, align=align)
    owners = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for rank in range(world_size):
        shard_positions = []
        for piece in layout.pieces(rank):
            owners[piece.param][piece.param_offset : piece.param_offset + piece.numel] += 1
            shard_positions.extend(range(piece.shard_offset, piece.shard_offset + piece.numel))
        assert len(set(shard_positions)) == len(shard_positions)
        assert all(0 <= s < layout.shard_numel for s in shard_positions)
    assert all(bool((o == 1).all()) for o in owners)
    for bucket in layout.buckets:
        assert bucket.padded_numel % world_size == 0
        assert 0 <= bucket.padded_numel - bucket.numel < world_size  # slices of ceil(numel / N), as torch.chunk splits (DCP)
        assert bucket.numel <= bucket_numel or len(bucket.params) == 1  # gaps included
        assert bucket.offset % align == 0 and all(layout.slots[i].offset % align == 0 for i in bucket.params)
        last = layout.slots[bucket.params[-1]]
        assert bucket.numel == last.offset + last.numel - bucket.offset
        assert bucket.numel - sum(numels[i] for i in bucket.params) < align * len(bucket.params)  # gaps: under align before each param
    ends = [b.offset + b.padded_numel for b in layout.buckets]
    assert [b.offset for b in layout.buckets] == [0, *(-(-end // align) * align for end in ends[:-1])]
    assert layout.numel == -(-ends[-1] // align) * align
    assert layout.shard_numel * world_size == sum(b.padded_numel for b in layout.buckets)


@settings(max_examples=100, deadline=None)
@given(numels=numels, bucket_numel=st.integers(1, 700), align=aligns)
def test_a_bucket_holds_its_params_alike_at_every_world_size(numels, bucket_numel, align):
    # The sharded checkpoint saves each bucket as one tensor of bucket.numel elements and reshards it by DCP: a param must
    # sit at the same place in its bucket whatever the world size.
    def within(world_size):
        layout = build_layout(numels, bucket_numel, world_size, align=align)
        return [(b.numel, [layout.slots[i].offset - b.offset for i in b.params]) for b in layout.buckets]
    assert all(within(world_size) == within(1) for world_size in range(2, 9))


@settings(max_examples=100, deadline=None)
@given(lines=st.lists(st.integers(1, 20), min_size=1, max_size=12), bucket_numel=st.integers(1, 700), world_size=st.integers(1, 8),
       align=aligns)
def test_params_of_whole_lines_are_laid_out_as_without_alignment(lines, bucket_numel, world_size, align):
    # Format version 2's buckets (packed end to end) are format 3's when every param is a whole number of lines (as for
    # most of a transformer's), so that such a version-2 checkpoint loads as it is (FlatParamBuffer.packed checks each bucket).
    numels = [n * align for n in lines]
    assert bucket_contents(build_layout(numels, bucket_numel, world_size, align=align)) == bucket_contents(build_layout(numels, bucket_numel, world_size))


@settings(max_examples=300, deadline=None)
@given(data=st.data(), numels=numels, bucket_numel=st.integers(1, 700), world_size=st.integers(1, 8), align=aligns)
def test_owned_layout_puts_each_param_whole_in_its_owners_slice(data, numels, bucket_numel, world_size, align):
    owners = data.draw(st.lists(st.integers(0, world_size - 1), min_size=len(numels), max_size=len(numels)))
    layout = build_layout(numels, bucket_numel, world_size, owners, align)
    footprints = [-(-n // align) * align for n in numels]
    assert layout.whole_params and layout.owners == tuple(owners)
    seen = []
    for rank in range(world_size):
        pieces = layout.pieces(rank)
        assert [p.param for p in pieces] == [i for i in range(len(numels)) if owners[i] == rank]  # each rank's params in the order given
        for piece in pieces:
            assert (piece.param_offset, piece.numel) == (0, numels[piece.param])  # whole
            lo, hi = layout.buckets[layout.slots[piece.param].bucket].rank_range(rank, world_size)
            assert lo <= piece.flat_offset and piece.flat_offset + piece.numel <= hi and piece.flat_offset % align == 0
            seen.extend(range(piece.flat_offset, piece.flat_offset + piece.numel))
    assert len(seen) == len(set(seen)) == sum(numels)  # no overlap, nothing lost
    for bucket in layout.buckets:
        size = bucket.shard_numel(world_size)
        assert bucket.padded_numel == size * world_size
        assert size <= max(-(-bucket_numel // world_size), *(footprints[i] for i in bucket.params))  # no slice larger than needed
        assert bucket.numel == sum(numels[i] for i in bucket.params)
        fill = [sum(footprints[i] for i in bucket.params if owners[i] == r) for r in range(world_size)]
        assert max(fill) == size  # slices are padded to the fullest one, no further
    assert layout.numel == sum(b.padded_numel for b in layout.buckets) and layout.shard_numel * world_size == layout.numel


@given(data=st.data(), numels=numels, bucket_numel=st.integers(1, 700), world_size=st.integers(1, 8), owned=st.booleans())
def test_within_one_slice_iff_one_rank_holds_the_whole_param(data, numels, bucket_numel, world_size, owned):
    owners = data.draw(st.lists(st.integers(0, world_size - 1), min_size=len(numels), max_size=len(numels))) if owned else None
    layout = build_layout(numels, bucket_numel, world_size, owners)
    whole = {p.param for rank in range(world_size) for p in layout.pieces(rank) if p.numel == numels[p.param]}
    assert [layout.within_one_slice(i) for i in range(len(numels))] == [i in whole for i in range(len(numels))]


def test_owned_layout_rejects_bad_owners():
    with pytest.raises(ValueError, match="owners has 1 entries for 2 params"):
        build_layout([3, 4], 10, 2, [0])
    with pytest.raises(ValueError, match=r"owners must be ranks in \[0, world_size=2\); got \(index, owner\) \[\(1, 2\)\]"):
        build_layout([3, 4], 10, 2, [0, 2])


shapes = st.lists(st.lists(st.integers(1, 7), min_size=0, max_size=3), min_size=1, max_size=8)


DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64])


@settings(max_examples=150, deadline=None)
@given(shapes=shapes, bucket_numel=st.integers(1, 200), world_size=st.integers(1, 5), dtype=DTYPES)
def test_flatten_shard_gather_unflatten_round_trip(shapes, bucket_numel, world_size, dtype):
    torch.manual_seed(0)
    originals = [torch.randn(shape).to(dtype) for shape in shapes]
    params = [nn.Parameter(t.clone()) for t in originals]
    buffer = FlatParamBuffer(params, bucket_numel, world_size)
    for p, t in zip(params, originals):  # params are now views with their old values
        assert p.shape == t.shape and torch.equal(p, t)
        assert p.untyped_storage().data_ptr() == buffer.data.untyped_storage().data_ptr()
        assert (p.data_ptr() - buffer.data.data_ptr()) % 64 == 0  # a 64-byte boundary, as torch's allocators place a tensor
    shards = [LocalShard(buffer, rank) for rank in range(world_size)]

    # Each rank's virtual params hold exactly its pieces of the originals (in master precision).
    for shard in shards:
        for piece, virtual in zip(shard.pieces, shard.virtual_params):
            expected = originals[piece.param].reshape(-1)[piece.param_offset : piece.param_offset + piece.numel]
            assert virtual.dtype == (torch.float32 if dtype.itemsize < 4 else dtype)
            assert torch.equal(virtual.detach(), expected.to(virtual.dtype))

    # Update every master, write back, "all-gather" by reading each rank's slices into a new
    # buffer, and unflatten: every param must show the update, padding untouched.
    with torch.no_grad():
        for shard in shards:
            for virtual in shard.virtual_params:
                virtual.mul_(2)
            shard.write_back()
    gathered = torch.zeros_like(buffer.data)
    for b in buffer.layout.buckets:
        for rank in range(world_size):
            start, end = b.rank_range(rank, world_size)
            gathered[start:end] = buffer.slice_view(b.index, rank)
    for i, t in enumerate(originals):
        assert torch.equal(buffer.param_view(i, of=gathered).view_as(t), (t.to(torch.float32 if dtype.itemsize < 4 else dtype) * 2).to(dtype))
    assert torch.equal(gathered, buffer.data)


def test_layout_rejects_bad_sizes():
    with pytest.raises(ValueError, match="world_size=0"):
        build_layout([3], 4, 0)
    with pytest.raises(ValueError, match="bucket_numel=0"):
        build_layout([3], 0, 2)
    with pytest.raises(ValueError, match="numels is empty"):
        build_layout([], 4, 2)
    with pytest.raises(ValueError, match=r"\(1, 0\)"):
        build_layout([3, 0], 4, 2)
    with pytest.raises(ValueError, match="rank=2"):
        build_layout([3], 4, 2).pieces(2)


def test_large_param_gets_own_bucket_and_padding_goes_last():
    layout = build_layout([5, 20, 3, 4], bucket_numel=10, world_size=4)
    assert [b.params for b in layout.buckets] == [(0,), (1,), (2, 3)]
    assert [(b.numel, b.padded_numel) for b in layout.buckets] == [(5, 8), (20, 20), (7, 8)]
    assert [s.offset for s in layout.slots] == [0, 8, 28, 31]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), numels=numels, bucket_numel=st.integers(1, 700), world_size=st.integers(1, 4), owned=st.booleans(),
       grad_dtype=st.sampled_from([torch.float64, torch.float32]), align=aligns)
def test_staging_bucket_equals_zeros_plus_every_gradient(data, numels, bucket_numel, world_size, owned, grad_dtype, align):
    """Stage 2's staging (held gradients written per run of adjacent slots, only what none wrote zeroed) equals zero-fill + add,
    reused buffers included, gradients of another dtype cast."""
    from zeroshard.reduce.bucket import StagingBuckets

    owners = data.draw(st.lists(st.integers(0, world_size - 1), min_size=len(numels), max_size=len(numels))) if owned else None
    layout = build_layout(numels, bucket_numel, world_size, owners, align)
    staging = StagingBuckets()
    for _ in range(2):  # the second round reuses the first round's buffers, dirty
        writes = data.draw(st.lists(st.integers(0, len(numels) - 1), max_size=2 * len(numels)))
        expected = {b.index: torch.zeros(b.padded_numel, dtype=torch.float64) for b in layout.buckets}
        for i in writes:
            grad = torch.randn(numels[i], dtype=grad_dtype)  # cast to the staging (reduce) dtype, float64
            slot = layout.slots[i]
            start = slot.offset - layout.buckets[slot.bucket].offset
            expected[slot.bucket][start : start + slot.numel] += grad
            staging.add((0, slot.bucket), i, grad, torch.float64)
        for b in layout.buckets:
            got = staging.pop((0, b.index), layout)
            if got is None:
                assert not any(layout.slots[i].bucket == b.index for i in writes)
                continue
            assert torch.equal(got, expected[b.index])
            got.fill_(float("nan"))  # dirty, as after a reduce-scatter
            staging.recycle(got)


def test_staging_copies_a_gradient_that_is_a_slice_of_a_larger_tensor():
    """Held until its bucket launches, a slice would keep the whole tensor alive (a new embedding row's gradient, cut from
    the gradient of ``torch.cat([frozen_table, new_rows])``): such a gradient is copied when it arrives, an own one held."""
    from zeroshard.reduce.bucket import StagingBuckets

    layout = build_layout([8, 8], bucket_numel=16, world_size=2)
    whole = torch.randn(1000, 8)
    own = torch.randn(8)
    staging = StagingBuckets()
    staging.add((0, 0), 0, whole[-1], torch.float32)
    staging.add((0, 0), 1, own, torch.float32)
    held = staging.buffers()
    assert [t.untyped_storage().nbytes() for t in held] == [8 * 4, 8 * 4] and held[1] is own
    expected = torch.cat([whole[-1], own])
    whole.zero_()  # the larger tensor written after the gradient arrived
    assert torch.equal(staging.pop((0, 0), layout), expected)
