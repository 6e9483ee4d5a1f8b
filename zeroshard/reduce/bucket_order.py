"""The order in which a ``GradReducer`` launches its gradient buckets, rebuilt once from the first backward.

See "Collective order" in ``docs/design.md`` (as DDP's ``Reducer::rebuild_buckets``): the ranks adopt data-parallel rank 0's
record of the order buckets became complete in; buckets it never completed follow, buckets added later are appended.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from zeroshard.comm import collectives
from zeroshard.comm.groups import ShardingGroups

logger = logging.getLogger("zeroshard")

Key = tuple[int, int]  # (shard, bucket)


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
        arrives after that (reentrant checkpoints, ``nested_backward.py``), the last note counts: later passes wait for it too."""
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
