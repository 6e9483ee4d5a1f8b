"""One optimizer step on the local shard: gradient statistics, loss scaling and overflow, the update."""
