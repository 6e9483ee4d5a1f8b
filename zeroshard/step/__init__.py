"""One optimizer step on the local shard: gradient statistics, loss scaling, the update.

The one overflow decision of several optimizers sharing a process group is the
:class:`~zeroshard.reduce.coordinator.ReduceCoordinator`'s.
"""
