"""What a ``GradReducer`` holds between hooks: a gradient arrived but not taken, a reduction launched but not waited for."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from zeroshard import collectives


@dataclass
class ArrivedGrad:
    """The gradient autograd accumulated last into param ``index`` of shard ``shard``, not taken yet.

    A gradient is taken (marked ready, moved into a staging bucket, its bucket launched) at the
    next gradient or at the end of backward, not in zeroshard's own post-accumulate-grad hook:
    the hooks registered after zeroshard's, the user's, run in between, and DDP, whose reducer
    hooks the grad accumulator after every such hook, reduces what they leave in ``.grad``.
    """

    shard: int
    index: int
    param: nn.Parameter
    grad: Tensor | None  # param dtype and shape, ``param.grad`` as zeroshard's hook left it
    version: int  # ``grad._version`` then

    @classmethod
    def of(cls, shard: int, index: int, param: nn.Parameter) -> ArrivedGrad:
        """The record of ``param``'s gradient as it is now."""
        return cls(shard, index, param, param.grad, param.grad._version if param.grad is not None else 0)

    def changed(self) -> bool:
        """Whether a hook wrote ``.grad`` in place or replaced it since the record was made."""
        return self.param.grad is not self.grad or (self.grad is not None and self.grad._version != self.version)


@dataclass
class PendingReduce:
    """One launched bucket reduce-scatter of bucket ``bucket`` of shard ``shard``."""

    work: collectives.AsyncWork | None  # the async work handle; None: nothing to wait for (a shard group of one)
    input: Tensor  # 1-D reduce dtype, the bucket's padded gradients (kept alive until work is done)
    output: Tensor  # 1-D reduce dtype, this rank's summed slice of the bucket
    shard: int
    bucket: int
