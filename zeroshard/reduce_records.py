"""What a ``GradReducer`` holds between hooks (a gradient arrived but not taken yet), and two helpers of its hooks."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass
class ArrivedGrad:
    """The gradient autograd accumulated last into param ``index`` of shard ``shard``, not taken yet.

    A gradient is taken (marked ready, moved into a staging bucket, its bucket launched) before the
    next gradient is accumulated or at the end of backward, not in zeroshard's own post-accumulate-grad hook:
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


def divides_first(reduce_dtype: torch.dtype) -> bool:
    """Whether gradients in ``reduce_dtype`` are divided by the data-parallel size before the sum (fp16), not after.

    fp16 overflows at 65504: summing N ranks' gradients first would overflow where one rank's
    does not, so each rank divides first, as DDP's default hook does. bf16 and fp32 divide after.
    """
    return reduce_dtype == torch.float16


def weak_method(method: Callable) -> Callable:
    """``method`` (bound to a GradReducer) called through a weak reference: a no-op once the reducer is gone."""
    ref = weakref.WeakMethod(method)

    def call(*args: object) -> None:
        live = ref()
        if live is not None:
            live(*args)

    return call
