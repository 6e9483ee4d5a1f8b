"""The order in which a ``GradReducer`` launches its gradient buckets, rebuilt once from the first backward.

Buckets start in a fixed order: flat buffers in param-group order, buckets in layout order
(reverse registration order). Where gradients become ready in another order — a param group
listed after another but reached first in backward (a GPT's no-decay group), a module registered
before the ones that run after it — a complete bucket would wait for buckets behind it in that
order, and its reduce-scatter would not overlap backward.

So, as DDP rebuilds its buckets after the first iteration (``Reducer::rebuild_buckets``), the
first reduced backward records the order in which buckets became complete. At its end, the ranks
agree on data-parallel rank 0's record (broadcast in the shard group, then across replicas), and
from then on buckets launch in that order, followed by any never completed in the record, in the
fixed order. Only the order changes: the layout, and so which rank owns which element of the
optimizer state and every checkpoint, stays as it was. Buckets added later (an unfrozen param, a
new param group) are appended to the order.
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
    """The launch order of a reducer's buckets, and the record of the first backward that rebuilds it.

    Attributes:
        order: ``(shard, bucket)`` pairs in launch order.
        recording: the buckets completed so far in the first reduced backward, in completion
            order; ``None`` once the order was rebuilt.
    """

    def __init__(self) -> None:
        self.order: list[Key] = []
        self._position: dict[Key, int] = {}
        self.recording: list[Key] | None = []

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, position: int) -> Key:
        return self.order[position]

    def position(self, key: Key) -> int:
        """Where bucket ``key`` is launched in the order (0: first)."""
        return self._position[key]

    def append(self, shard: int, buckets: int) -> None:
        """Launch the ``buckets`` buckets of shard ``shard`` after every bucket known so far, in layout order."""
        for b in range(buckets):
            self._position[(shard, b)] = len(self.order)
            self.order.append((shard, b))

    def completed(self, key: Key) -> None:
        """Note that every gradient of bucket ``key`` arrived (recorded in the first reduced backward only).

        Noted again when one more arrives after that (reentrant checkpoints, ``zeroshard/reduce/nested_backward.py``):
        the last note counts, as later passes wait for that gradient too.
        """
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
        index = {key: i for i, key in enumerate(fixed)}
        agreed = torch.tensor([index[key] for key in recorded], dtype=torch.int64)
        for group in groups.all():
            if dist.get_world_size(group) > 1:
                device = collectives.collective_device(group)
                moved = agreed.to(device)
                work = dist.broadcast(moved, src=dist.get_global_rank(group, 0), group=group, async_op=True)
                collectives.wait(work, timeout, "the end of the first backward: the broadcast of the bucket launch order",
                                 "run the same backward passes (outside no_sync()) and step() calls")
                agreed = moved.cpu()
        self.recording = None
        self.order = [fixed[i] for i in agreed.tolist()]
        self._position = {key: i for i, key in enumerate(self.order)}
        if self.order != fixed and dist.get_rank() == 0:
            logger.info("zeroshard: %d of %d gradient buckets now launch in the order their gradients became ready in the first backward",
                        sum(a != b for a, b in zip(self.order, fixed)), len(fixed))
