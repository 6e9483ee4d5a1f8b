"""The ``.grad`` user code reads (sharded and virtual gradients, norms reduced when read) and what a GradScaler did to it."""
