"""A reducer's gradient buckets: their launch order, and each one's reduction: staged (stage 2), launched, completed into
this rank's slice of the grad shard.

See [Note: zeroshard buffers] in ``zeroshard/layout/flat_buffer.py``, and "One step" and "Collective order" in ``docs/design.md``.

Launch order: as DDP's ``Reducer::rebuild_buckets``, the ranks adopt data-parallel rank 0's record of the order buckets became
complete in during the first reduced backward; buckets it never completed follow, buckets added later are appended.

Staging (stage 2): a bucket's gradients are held as autograd made them until the bucket launches (as FSDP2 holds a
module's), then written into a 1-D staging buffer in the reduce dtype, taken from a pool without zeroing: one ``torch.cat``
per run of adjacent slots (a copy per param cost two operators per param and backward), zeroing only what no gradient
wrote. Holding costs at most one bucket of memory; :meth:`StagingBuckets.clear` drops every buffer between steps.

Reduction: where the slice holds nothing to keep (stage 1; stage 2's first reduction since the last reset) and has the
reduce dtype, the reduce-scatter writes into it: no temporary, nothing copied or added at completion, the sum divided in
place. Otherwise (another reduce dtype, stage 2's later reductions, a shard group of one) a temporary is converted and
copied (stage 1) or added (stage 2) into the slice at completion.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from zeroshard.comm import collectives
from zeroshard.comm.groups import ShardingGroups
from zeroshard.grad.shard_grads import ShardGrads
from zeroshard.layout.partition import FlatLayout

logger = logging.getLogger("zeroshard")

Key = tuple[int, int]  # (shard, bucket)

# Stage 2's bucket reductions in flight at most (DeepSpeed ZeRO-2's double buffering): staging memory ~ this + 1 buckets.
MAX_BUCKETS_IN_FLIGHT = 2


class BucketOrder:
    """The launch order of a reducer's buckets, and the record of the first backward that rebuilds it."""

    def __init__(self) -> None:
        self.order: list[Key] = []  # in launch order
        self.position: dict[Key, int] = {}  # where each bucket is in ``order`` (0: launched first)
        self.recording: list[Key] | None = []  # completed so far in the first reduced backward, in order; None once rebuilt

    def append(self, shard: int, buckets: int) -> None:
        """Launch the ``buckets`` buckets of shard ``shard`` after every bucket known so far, in layout order."""
        for b in range(buckets):
            self.position[(shard, b)] = len(self.order)
            self.order.append((shard, b))

    def completed(self, key: Key) -> None:
        """Note that every gradient of bucket ``key`` arrived (in the first reduced backward only); noted again when one more
        arrives after that (reentrant checkpoints, ``OutermostBackward``), the last note counts: later passes wait for it too."""
        if self.recording is not None:
            self.recording.append(key)

    def rebuild(self, groups: ShardingGroups, timeout: datetime.timedelta | None) -> None:
        """Adopt data-parallel rank 0's recorded order (two broadcasts; a collective on every rank); once.

        Raises:
            RuntimeError: with ``timeout``, a broadcast some rank did not join in time.
        """
        if self.recording is None:
            return
        fixed = list(self.order)
        seen = set(self.recording)
        last_noted = list(dict.fromkeys(reversed(self.recording)))[::-1]
        recorded = last_noted + [key for key in fixed if key not in seen]
        agreed = torch.tensor([self.position[key] for key in recorded], dtype=torch.int64)  # indices into ``fixed``
        for group in groups.all():
            if dist.get_world_size(group) > 1:
                moved = agreed.to(collectives.collective_device(group))
                work = dist.broadcast(moved, src=dist.get_global_rank(group, 0), group=group, async_op=True)
                collectives.wait(work, timeout, "the end of the first backward: the broadcast of the bucket launch order",
                                 "run the same backward passes (outside no_sync()) and step() calls")
                agreed = moved.cpu()
        self.recording = None
        self.order = [fixed[i] for i in agreed.tolist()]
        self.position = {key: i for i, key in enumerate(self.order)}
        if self.order != fixed and dist.get_rank() == 0:
            logger.info("zeroshard: %d of %d gradient buckets now launch in the order their gradients became ready in the first backward",
                        sum(a != b for a, b in zip(self.order, fixed)), len(fixed))


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


def divides_first(reduce_dtype: torch.dtype) -> bool:
    """Whether gradients in ``reduce_dtype`` are divided by the data-parallel size before the sum (fp16), not after.

    fp16 overflows at 65504: summing N ranks' gradients first would overflow where one rank's does not, so each rank
    divides first, as DDP's default hook does. bf16 and fp32 divide after.
    """
    return reduce_dtype == torch.float16


def stage1_input(flat: Tensor, dtype: torch.dtype, world_size: int) -> tuple[Tensor, bool]:
    """Stage 1's input (1-D, ``dtype``) for one bucket's reduce-scatter, and whether the collective may not write into it (``input_frozen``):
    ``flat``, the bucket's view of the flat grad buffer (the running sum), itself, or a cast, or a copy where it would be written."""
    if flat.dtype != dtype:
        return flat.to(dtype), True
    frozen = divides_first(dtype) or world_size == 1
    return (flat.clone() if frozen else flat), frozen


@dataclass
class PendingReduce:
    """One launched reduce-scatter of bucket ``bucket`` of shard ``shard``."""

    work: collectives.AsyncWork | None  # the async work handle; None: nothing to wait for (a shard group of one)
    input: Tensor  # 1-D reduce dtype, the bucket's padded gradients (kept alive until work is done)
    output: Tensor  # 1-D reduce dtype, this rank's summed slice of the bucket: ``target`` itself, or a temporary
    target: Tensor  # 1-D master dtype, this rank's slice of the bucket in the grad shard
    shard: int
    bucket: int

    @property
    def what(self) -> str:
        """How a timeout error names this reduction."""
        return f"the reduce-scatter of gradient bucket {self.shard}.{self.bucket}"


def launch(grads: Tensor, target: Tensor, groups: ShardingGroups, shard: int, bucket: int, *, fresh: bool, input_frozen: bool) -> PendingReduce:
    """Start the reduce-scatter of one bucket's gradients over the shard group.

    Args:
        grads: 1-D reduce dtype, ``n * shard_size`` elements: this rank's gradients of the bucket, padded. Divided by the
            data-parallel size in place first when :func:`divides_first`.
        target: 1-D master dtype, ``n`` elements: this rank's slice of the bucket in the grad shard.
        shard, bucket: which bucket, for errors.
        fresh: ``target`` holds nothing to keep (module docstring): with the reduce dtype, the reduce-scatter writes into it.
        input_frozen: nothing writes ``grads`` before the reduction completes (a staging bucket, a copy), so the
            point-to-point reduce-scatter reads this rank's own piece at the end (:func:`zeroshard.comm.collectives.reduce_scatter`).
    """
    if divides_first(grads.dtype):
        grads.div_(groups.data_parallel_size)
    if groups.shard_size == 1:  # a shard group of one: the bucket is this rank's slice, no collective
        return PendingReduce(None, grads, grads, target, shard, bucket)
    output = target if fresh and grads.dtype == target.dtype else torch.empty(target.numel(), dtype=grads.dtype, device=grads.device)
    work = collectives.reduce_scatter(output, grads, groups.shard, input_frozen=input_frozen)
    return PendingReduce(work, grads, output, target, shard, bucket)


def complete(pending: PendingReduce, groups: ShardingGroups, timeout: datetime.timedelta | None, *, overwrite: bool) -> None:
    """Wait for one reduction (:func:`wait`) and leave ``sum over data-parallel ranks / their number`` in its slice of the grad
    shard. ``overwrite``: the sum replaces what the slice holds (stage 1) or is added to it (stage 2).
    """
    wait(pending.work, timeout, pending.what)  # the summed slice must have arrived before it is read
    if groups.replicate is not None:
        # Hybrid: the same slice on every replica, summed across them (MiCS, §3).
        wait(collectives.all_reduce(pending.output, groups.replicate), timeout,
             f"the all-reduce across replicas of gradient bucket {pending.shard}.{pending.bucket}")
    reduced = pending.output.to(pending.target.dtype)
    if not divides_first(pending.output.dtype) and groups.data_parallel_size > 1:
        reduced.div_(groups.data_parallel_size)
    if reduced is not pending.target:  # else the reduce-scatter wrote the slice itself
        (pending.target.copy_ if overwrite else pending.target.add_)(reduced)


def wait(work: collectives.AsyncWork | None, timeout: datetime.timedelta | None, what: str) -> None:
    """Wait for a reducer's collective ``what`` (``None``: a shard group of one, nothing was sent), raising ``RuntimeError``
    after ``timeout`` (``None``: the group's), naming it and what every rank must run alike."""
    if work is not None:
        collectives.wait(work, timeout, f"backward, step() or a read of opt.param_groups' .grad after no_sync(): {what}",
                         "run the same backward passes (outside no_sync()), gradient reads and step() calls, with the same params used")


def unshard(grads: list[ShardGrads], groups: ShardingGroups, timeout: datetime.timedelta | None) -> None:
    """Make the reduced gradients whole again on every rank (``GradReducer``, before a ``no_sync()`` backward that follows a
    backward that reduced): per shard, an all-gather per bucket over the shard group into a 1-D tensor in the grad shard's
    dtype and the flat buffer's layout, and where any rank gave each param a gradient (an all-reduce MAX over each reducing
    group in turn), then :meth:`~zeroshard.grad.shard_grads.ShardGrads.unshard`."""
    what = "the all-gather of the reduced gradients before no_sync() (unshard)"
    fulls, works = [], []
    for g in grads:
        full = torch.zeros_like(g.shard.buffer.data, dtype=g.shard.grad_shard.dtype)
        works += [collectives.all_gather(g.shard.buffer.bucket_view(chunk.bucket, of=full), chunk.grad, groups.shard) for chunk in g.shard.chunks]
        fulls.append(full)
    used = torch.tensor([u for g in grads for u in g.used], dtype=torch.uint8, device=collectives.collective_device(groups.shard))
    for group in groups.reducing:  # one after the other: each reads what the last wrote
        wait(collectives.all_reduce(used, group, dist.ReduceOp.MAX), timeout, what)
    for work in works:
        wait(work, timeout, what)
    flags = [bool(u) for u in used.tolist()]
    for g, full in zip(grads, fulls):
        g.unshard(full, flags[: len(g.used)])
        flags = flags[len(g.used) :]
