"""Collectives and process groups: typed wrappers with timeouts that name the collective, and the shard / replicate groups."""
