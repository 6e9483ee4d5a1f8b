"""Where every element lives: partition math, whole-param ownership, flat buffers, chunks and local shards."""
