"""Optimizer checkpoints: the sharded (DCP) and full formats of both partitions, directories, offline conversion."""
