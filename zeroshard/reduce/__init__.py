"""Backward: gradient hooks, buckets, their reduce-scatter and the DDP wrapper around the same params."""
