"""zeroshard: a drop-in ZeRO stage 1/2 optimizer wrapper for PyTorch.

Replace ``torch.optim.AdamW(...)`` with ``zeroshard.ShardedOptimizer(torch.optim.AdamW(...))``
and launch with ``torchrun``. See ``docs/`` for the design and API reference.
"""

from zeroshard.groups import hybrid_mesh
from zeroshard.memory import MemoryUsage
from zeroshard.optimizer import ShardedOptimizer

__all__ = ["MemoryUsage", "ShardedOptimizer", "hybrid_mesh"]
__version__ = "0.1.0"
