"""zeroshard: a drop-in ZeRO stage 1/2 optimizer wrapper for PyTorch.

Replace ``torch.optim.AdamW(...)`` with ``zeroshard.ShardedOptimizer(torch.optim.AdamW(...))``
and launch with ``torchrun``. See ``docs/`` for the design and API reference.
"""

from zeroshard.checkpoint.dirs import latest_checkpoint, verify_checkpoint
from zeroshard.clip import clip_grad_norm_
from zeroshard.comm.groups import hybrid_mesh
from zeroshard.memory import MemoryUsage, estimate_memory
from zeroshard.offload.placement import MarginMeasurement, MemoryTracer, Placement
from zeroshard.optimizer import ShardedOptimizer
from zeroshard.step.loss_scaler import DynamicLossScaler

__all__ = [
    "DynamicLossScaler", "MarginMeasurement", "MemoryTracer", "MemoryUsage", "Placement", "ShardedOptimizer",
    "clip_grad_norm_", "estimate_memory", "hybrid_mesh", "latest_checkpoint", "verify_checkpoint",
]
__version__ = "0.1.0"
