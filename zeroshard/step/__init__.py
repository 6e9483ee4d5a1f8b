"""One optimizer step on the local shard: gradient statistics, loss scaling, the update (several optimizers' shared overflow
decision: :class:`~zeroshard.reduce.coordinator.ReduceCoordinator`)."""
