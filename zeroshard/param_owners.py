"""Which live ``GradReducer`` owns each param's gradients: one at most, the newest.

A param carries the gradient hooks of one reducer at most. Rebuilding an optimizer on the same
params (``opt = ShardedOptimizer(...)`` while the old ``opt`` is still bound) is ordinary
PyTorch, so a newer reducer takes the params over and the older one is closed (stepping it then
raises, naming the param).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from zeroshard.ddp_wrapper import DDPWrappers
    from zeroshard.grad_reducer import GradReducer

# id(param) -> (the param, the GradReducer whose hooks it carries), both held weakly: which live
# optimizer owns a param's gradients. A param carries the hooks of one reducer at most.
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def register_owner(param: nn.Parameter, reducer: GradReducer) -> None:
    """Record that ``reducer``'s hooks are on ``param`` (both held weakly)."""
    _OWNERS[id(param)] = (weakref.ref(param), weakref.ref(reducer))


def owner_of(param: nn.Parameter) -> GradReducer | None:
    """The live, open reducer whose hooks are on ``param``, or ``None``."""
    entry = _OWNERS.get(id(param))
    if entry is None:
        return None
    held, reducer = entry[0](), entry[1]()
    if held is not param or reducer is None or reducer.closed:
        del _OWNERS[id(param)]
        return None
    return reducer


def take_over(params: Sequence[nn.Parameter], names: Sequence[str]) -> None:
    """Close every live reducer that hooks one of ``params``: a new optimizer takes them over.

    Two optimizers hooked on one param would both take its gradient (stage 2: the newer one would
    never see one; stage 1: every backward reduced twice). Rebuilding an optimizer on the same
    params (``opt = ShardedOptimizer(...)`` while the old ``opt`` is still bound) is ordinary
    PyTorch, so the newer one wins, and the older one raises if it is stepped again.
    """
    for param, name in zip(params, names):
        owner = owner_of(param)
        if owner is not None:
            owner.close(f"{name} (shape {tuple(param.shape)}) was taken over by a ShardedOptimizer built later on the same params: "
                        "step that one (two optimizers cannot both reduce one param's gradients)")


def ddp_wrappers_of_owners(params: Iterable[nn.Parameter]) -> list[DDPWrappers]:
    """The :class:`DDPWrappers` of every live reducer that owns one of ``params``."""
    owners = {id(owner): owner for p in params if (owner := owner_of(p)) is not None}
    return [owner.ddp_wrappers for owner in owners.values()]
