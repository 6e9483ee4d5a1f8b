"""What a ``GradReducer`` holds between hooks (a gradient arrived but not taken yet, where the step's gradients are), and
the weak calls its hooks make."""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


class StepPhase(enum.Enum):
    """Where a step's gradients are, from one ``reset()`` (``step()``, ``zero_grad()``) to the next."""

    LOCAL = "local"  # no backward reduced yet: .grad holds this rank's own gradients (micro-steps under no_sync, or none)
    REDUCED = "reduced"  # reduced: each .grad is DDP's averaged gradient (a ShardedGrad), nothing accumulated locally since
    REDUCED_THEN_LOCAL = "reduced_then_local"  # reduced, then more accumulated locally (no_sync) or shards added: step() reduces again


@dataclass(slots=True)
class ArrivedGrad:
    """The gradient autograd accumulated last into param ``index`` of shard ``shard``, not taken yet because a post-accumulate-grad
    hook is registered after zeroshard's on the param: it is taken before the next gradient is accumulated or at the end of
    backward, once those hooks have run, as DDP sees it ("One step", ``docs/design.md``).
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


def weak_method(method: Callable) -> Callable:
    """``method`` (bound to a GradReducer or an optimizer) called through a weak reference: a no-op (``None``) once its object is gone."""
    ref = weakref.WeakMethod(method)

    def call(*args: object) -> object:
        live = ref()
        return live(*args) if live is not None else None

    return call


def param_hooks(reducer: Any, shard: int, index: int, param: nn.Parameter) -> tuple[Callable, Callable]:
    """The tensor pre-hook and post-accumulate-grad hook of param ``index`` of shard ``shard``, calling ``reducer``'s
    ``before_accumulate`` and ``on_grad_ready``; both hold the reducer and the param weakly (no-ops once either is gone).
    Under ``backward(create_graph=True)`` (grad mode on) they run under ``torch.no_grad()``: values only, as DDP's reducer.
    """
    reducer_ref, param_ref = weakref.ref(reducer), weakref.ref(param)

    def pre_hook(grad: Tensor) -> None:  # before autograd accumulates ``grad`` into ``param.grad``
        live, held = reducer_ref(), param_ref()
        if live is not None and held is not None:
            if torch.is_grad_enabled():  # backward(create_graph=True)
                with torch.no_grad():
                    return live.before_accumulate(shard, index, held, grad)
            live.before_accumulate(shard, index, held, grad)

    def post_hook(held: nn.Parameter) -> None:  # once ``held.grad`` holds the accumulated gradient
        live = reducer_ref()
        if live is not None:
            if torch.is_grad_enabled():
                with torch.no_grad():
                    return live.on_grad_ready(shard, index, held)
            live.on_grad_ready(shard, index, held)

    return pre_hook, post_hook
