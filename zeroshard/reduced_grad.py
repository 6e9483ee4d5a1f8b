"""What a param's ``.grad`` holds once ZeRO stage 2 has reduce-scattered it: a ``ReducedGrad``.

See [Note: zeroshard buffers] in ``zeroshard/flat_buffer.py`` for the grad shard.

Stage 2 moves each gradient into the optimizer's grad shard during backward, so the full gradient
no longer exists on any rank. Leaving ``.grad`` as ``None`` would make that invisible: a
``model.zero_grad()`` that drops a bad batch, or ``zero_grad(set_to_none=False)`` that keeps a zero
gradient (which ``torch.optim`` still steps), could not be told from doing nothing, and
``torch.nn.utils.clip_grad_norm_`` would clip by a norm of 0. So ``.grad`` becomes a
``ReducedGrad``: a zero-memory tensor of the param's shape (one element, expanded) that

* ``model.zero_grad()`` can set to ``None`` and ``zero_grad(set_to_none=False)`` can zero (its
  version counter then moves), both of which the reducer reads (``GradReducer._settle``);
* raises a ``RuntimeError`` that names the param and the supported path on any other use, such
  as torch's or a framework's gradient clipping, or reading the values;
* the reducer removes before autograd accumulates the next gradient into the param.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zeroshard.amp import GradScalerLink

# Torch functions a ReducedGrad allows: attribute reads, the calls nn.Module.zero_grad makes, and
# what printing and nn.Module._apply (model.to(...) to where the param already is) need.
_ALLOWED = frozenset({
    "__get__", "__set__", "__format__", "size", "dim", "numel", "nelement", "stride", "element_size",
    "is_contiguous", "is_floating_point", "is_complex", "requires_grad_", "detach_", "zero_", "_is_view",
    "_has_compatible_shallow_copy_type",
})
# Conversions nn.Module._apply applies to every .grad (model.to(), .cpu(), .double(), ...). They return the
# ReducedGrad itself: the gradient stays in the grad shard, and whether the params' move can be followed
# is decided for the params (FlatParamBuffer.follow).
_CONVERSIONS = frozenset({"to", "cpu", "cuda", "float", "double", "half", "bfloat16", "type"})


class ReducedGrad(torch.Tensor):
    """A param's ``.grad`` under ZeRO stage 2 after the gradient moved into the grad shard.

    Shape and dtype of the param, one element of storage (stride 0 everywhere). Created by
    :func:`reduced_grad`; see the module docstring for what it allows.
    """

    param_name: str  # how errors name the param: "param_groups[g]['params'][j]"
    location: str  # where its gradient is, for errors (not ``where``: that is ``Tensor.where``)
    amp_link: GradScalerLink | None = None  # a virtual param's: where a GradScaler's unscale_ goes (zeroshard/amp.py)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # shows no values it does not hold
        return f"ReducedGrad({self.param_name}, shape={tuple(self.shape)}, dtype={self.dtype}: {self.location})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in _ALLOWED:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if name == "_amp_foreach_non_finite_check_and_unscale_" and args and isinstance(args[0], list):
            # torch.amp.GradScaler's unscale_ (or inf check) of one ShardedOptimizer's virtual params: to its link (zeroshard/amp.py)
            links = {getattr(g, "amp_link", None) for g in args[0]}
            link = links.pop() if len(links) == 1 else None
            if link is not None:
                link.unscale_(args[1], args[2])
                return None
        self = next((a for a in args if isinstance(a, ReducedGrad)), None)
        if self is not None and name in _CONVERSIONS:
            return self
        label = f"{self.param_name}: {self.location}" if self is not None else "a param's gradient is in the optimizer's grad shard"
        raise RuntimeError(
            f"{label}, so no rank holds it as a tensor (torch.{name} was called on it). Clip with ShardedOptimizer(..., max_grad_norm=...) or "
            "opt.clip_grad_norm_(...) "
            "and read opt.grad_norm (HF Trainer, accelerate, Lightning: use zeroshard.integrations, see docs/integrations.md); "
            "drop a batch with model.zero_grad() or opt.zero_grad(); use stage=1 to keep full gradients on the model's params"
        )


REDUCED = "its gradient was reduce-scattered into the optimizer's grad shard (ZeRO stage 2)"
VIRTUAL = "a virtual param of the wrapped optimizer (this rank's piece of a param), whose gradient is attached only inside step()"


def reduced_grad(param: nn.Parameter, name: str, where: str = REDUCED) -> ReducedGrad:
    """A new ``ReducedGrad`` for ``param`` (its shape, dtype and device; one element of storage).

    ``where`` says where the gradient is instead, for errors: :data:`REDUCED` for a model's param
    under stage 2, :data:`VIRTUAL` for a virtual param between steps (a framework that clips the
    optimizer's ``param_groups``, as Lightning does, would otherwise see ``None`` and clip nothing).
    """
    grad = torch.Tensor._make_subclass(ReducedGrad, torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape))
    grad.param_name, grad.location = name, where
    return grad
