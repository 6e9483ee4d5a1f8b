"""The update of optimizers other than the fused Adam/AdamW (their own ``step()`` on the virtual params), the multiplier every
path applies to the gradients, and what state the wrapped optimizer keeps for a param (for checkpoints and memory estimates)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from zeroshard.layout.local_shard import LocalShard


def grad_multiplier(norm: float, loss_scale: float, max_norm: float | None) -> float:
    """What the reduced gradients are multiplied by: ``1 / loss_scale`` times the clip coefficient.

    ``norm`` is the global norm of the still-scaled gradients; the clip coefficient is
    ``min(1, max_norm / (norm / loss_scale + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``'s.
    """
    coefficient = 1.0 if max_norm is None else min(1.0, max_norm / (norm / loss_scale + 1e-6))
    return coefficient / loss_scale


@torch.no_grad()
def wrapped_step(optimizer: torch.optim.Optimizer, shards: list[LocalShard], used: list[list[bool]], multiplier: float) -> None:
    """Run ``optimizer.step()`` on the virtual params, each with its piece of the grad shards (multiplied by ``multiplier``
    in place) as ``.grad``, or ``None`` where ``used`` (per shard, per param) says no rank gave the param a gradient; then
    16-bit params receive the cast of their updated masters (without ``master_weights`` the virtual params are the params' views).
    """
    for shard, flags in zip(shards, used):
        if multiplier != 1.0:
            shard.grad_shard.mul_(multiplier)
        shard.attach_grads(flags)
    _STEPPING.add(id(optimizer))
    try:
        optimizer.step()
    finally:
        _STEPPING.discard(id(optimizer))
    for shard in shards:
        shard.detach_grads()
        shard.write_back()


_STEPPING: set[int] = set()  # ids of wrapped optimizers inside wrapped_step


def refuse_direct_steps(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.step()`` raise ``RuntimeError`` outside :func:`wrapped_step`: it would update this rank's shard alone."""
    def refuse(stepped: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if id(stepped) not in _STEPPING:
            raise RuntimeError(f"{type(stepped).__name__}.step() was called on the optimizer a ShardedOptimizer wraps: it updates this rank's "
                               "shard only, and no rank gathers the result. Call the ShardedOptimizer's step() (opt.step(), not opt.optimizer.step())")

    optimizer.register_step_pre_hook(refuse)


def is_subclass_state(value: Any) -> bool:
    """Whether ``value`` is a tensor subclass that follows PyTorch's flatten/unflatten protocol (torchao's ``OptimState8bit``)."""
    return isinstance(value, Tensor) and type(value) not in (Tensor, nn.Parameter) and hasattr(type(value), "__tensor_flatten__")


def constructor_kwargs(cls: type, hyperparameters: dict[str, Any]) -> dict[str, Any]:
    """The entries of a param group's ``hyperparameters`` that ``cls(params, **kwargs)`` takes: those its ``__init__`` names,
    or all of them (``"params"`` aside) when it takes ``**kwargs`` (a subclass that forwards them to its base class)."""
    accepted = inspect.signature(cls).parameters
    forwards = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    return {k: v for k, v in hyperparameters.items() if k != "params" and (forwards or k in accepted)}


def throwaway_state(cls: type, hyperparameters: dict[str, Any], shape: Any, dtype: torch.dtype, device: Any) -> dict[str, Any]:
    """The state ``cls`` built with a param group's ``hyperparameters`` (:func:`constructor_kwargs`) keeps after one step of a
    zero param of ``shape``, ``dtype`` and ``device`` with a zero gradient. Raises whatever the class raises.

    The step runs eagerly: an update under ``torch.compile`` (torchao's low-bit AdamW) would be compiled again for each probe."""
    probe = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
    probe.grad = torch.zeros_like(probe)
    throwaway = cls([probe], **constructor_kwargs(cls, hyperparameters))
    with torch.compiler.set_stance("force_eager"):
        throwaway.step()
    return throwaway.state[probe]
