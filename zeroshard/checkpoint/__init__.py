"""Optimizer checkpoints: the sharded (DCP) and full formats of both partitions, and checkpoint directories."""
