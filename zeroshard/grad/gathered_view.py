"""Views of a reduced gradient's gathered values that refuse writes: under DDP ``p.grad.view(-1).mul_(c)`` or
``p.grad[0].zero_()`` changes the gradient; on a ``ShardedGrad`` (``sharded_grad.py``), whose values are gathered for any read
but its norms and elementwise edits, such a write would change a gathered copy only, silently."""

from __future__ import annotations

import operator
from typing import Any

from torch import Tensor

from zeroshard.compat import DisableTorchFunctionSubclass, make_subclass

_INPLACE_OPERATORS = frozenset({"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__", "__iand__",
                                "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__setitem__", "__set__"})


class GatheredView(Tensor):
    """A view of a ``ShardedGrad``'s gathered values (``p.grad.view(-1)``, ``p.grad[0]``, ``p.grad.t()``): reads run as on a
    plain tensor; an in-place write, which would change DDP's gradient but here only a copy, raises ``RuntimeError``."""

    param_name: str  # the param whose gradient it views, as errors name it

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(t is not GatheredView for t in types):
            return NotImplemented  # a ShardedGrad among the arguments: its __torch_function__ gathers it (read here, it is NaN)
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        targets = [kwargs.get("out")] + (first_argument(args) if writes_first_argument(func, name) else [])
        if (written := next((t for t in targets if isinstance(t, GatheredView)), None)) is not None:
            raise RuntimeError(f"{written.param_name}: torch.{name} would write into a view of its gradient, which zeroshard holds as "
                               "pieces on several ranks (ZeRO), not into the gradient. Edit p.grad itself (elementwise: mul_, div_, "
                               "clamp_, add_, copy_, zero_, nan_to_num_), or assign a new one (p.grad = t)")
        with DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        return views_refuse_edits(result, args, args)


def first_argument(args: Any) -> list[Any]:
    """``args[0]``, or the tensors of a list there (``torch._foreach_*``)."""
    return [] if not args else list(args[0]) if isinstance(args[0], (list, tuple)) else [args[0]]


def writes_first_argument(func: Any, name: str) -> bool:
    """Whether ``func`` (named ``name``) writes into its first argument: an in-place method or operator, or a ``torch.distributed`` call."""
    return (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_OPERATORS or getattr(func, "__module__", "").startswith("torch.distributed")


def views_refuse_edits(result: Any, args: Any, gathered: Any) -> Any:
    """``result`` of a function run on ``gathered`` (``args`` with each ``ShardedGrad`` gathered into a plain tensor), with each
    tensor in it that shares storage with the gathered values of a gradient in ``args`` (a ``ShardedGrad`` or ``GatheredView``,
    which have a ``param_name``) made a :class:`GatheredView`, and a NumPy array of them (``.numpy()``) made read-only."""
    with DisableTorchFunctionSubclass():
        sources = {g.untyped_storage().data_ptr(): a.param_name for a, g in zip(args, gathered)
                   if isinstance(a, Tensor) and hasattr(a, "param_name") and isinstance(g, Tensor)}
    if not sources:
        return result
    if isinstance(result, (list, tuple)):  # split, chunk, unbind
        marked = [views_refuse_edits(r, args, gathered) for r in result]
        return result if all(map(operator.is_, marked, result)) else type(result)(marked)
    if isinstance(result, Tensor):
        with DisableTorchFunctionSubclass():
            name = sources.get(result.untyped_storage().data_ptr())
        if name is not None:
            view = make_subclass(GatheredView, result)
            view.param_name = name
            return view
    elif type(result).__name__ == "ndarray" and hasattr(result, "flags"):  # writes into it would miss the gradient too
        result.flags.writeable = False
    return result
