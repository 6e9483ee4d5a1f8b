"""Gradient norms whose cross-rank reduction waits until a value is read: ``PartialNorm``.

A gradient norm over sharded gradients needs one collective: each rank holds a part of every
gradient (``ShardedGrad``, a model param's) or a part of the param list (``VirtualGrad`` s, the
wrapped optimizer's). ``torch.nn.utils.clip_grad_norm_`` takes one norm per gradient, stacks them
and takes the norm of the stack; a ``PartialNorm`` keeps this rank's sum of ``|x| ** ord`` (the
largest ``|x|`` for ``inf``) through ``torch.stack``, ``.to(device)`` and that outer norm, and
reduces over the ranks at the first read of a value (arithmetic, ``.item()``, printing). So a whole
clip costs one all-reduce, foreach or not, as FSDP2's DTensor norms with a partial placement do
(``torch/distributed/tensor/_ops/_math_ops.py``).

What a norm means follows what the gradient is:

* a ``ShardedGrad`` (a model param's gradient): the norm of the whole param's gradient over every
  rank: its value is reduced whenever it is read;
* a ``VirtualGrad`` (a virtual param's, this rank's piece of a param): the piece is this rank's own
  tensor, so its norm alone is local; a norm over several of them (the stack's) spans the optimizer's
  params on every rank, which is what clipping ``opt.param_groups`` means: it is reduced.

Reading a value is a collective over the shard group (``collective_timeout_s`` bounds it): every
rank must read the same norms in the same order (see ``docs/design.md``).
"""

from __future__ import annotations

import datetime
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from zeroshard import collectives

_HINT = "read the same gradient values alike (a norm, a clip or full_tensor() of a param's .grad is a collective over the data-parallel ranks)"


@dataclass(frozen=True)
class GradComm:
    """Where the pieces of one optimizer's gradients are: its shard group, and the bound on each wait.

    The grad shards are the same in every replica of hybrid sharding, so the shard group covers them.
    """

    group: ProcessGroup
    timeout: datetime.timedelta | None

    @property
    def size(self) -> int:
        """The number of ranks the pieces are spread over."""
        return dist.get_world_size(self.group)

    def sum_(self, tensor: Tensor, what: str) -> Tensor:
        """All-reduce ``tensor`` in place (SUM) over the group and return it (no collective for a group of one).

        Raises:
            RuntimeError: with a timeout, a rank did not join in time (names ``what``).
        """
        if self.size > 1:
            collectives.wait(collectives.all_reduce(tensor, self.group), self.timeout, what, _HINT)
        return tensor

    def max(self, tensor: Tensor, what: str) -> Tensor:
        """Elementwise maximum of ``tensor`` over the group, NaN-propagating (gloo's MAX drops a NaN unless rank 0 holds it).

        Raises:
            RuntimeError: with a timeout, a rank did not join in time (names ``what``).
        """
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        collectives.wait(dist.all_gather(parts, tensor, group=self.group, async_op=True), self.timeout, what, _HINT)
        return torch.stack(parts).amax(dim=0)


def norm_order(ord: Any) -> float:
    """``ord`` of a vector norm as a float (``"fro"`` is 2).

    Raises:
        ValueError: an order whose parts cannot be summed over ranks (``<= 0``, ``-inf``, a string other than ``"fro"``).
    """
    value = 2.0 if ord is None or ord == "fro" else ord
    if isinstance(value, str) or not float(value) > 0:
        raise ValueError(f"ord={ord!r}: a norm of a sharded gradient takes a positive order or inf (its parts are summed over ranks)")
    return float(value)


def local_power_sum(pieces: Sequence[Tensor], ord: float) -> Tensor:
    """This rank's part of a norm: ``sum |x| ** ord`` over ``pieces`` (``max |x|`` for ``inf``), 0-dim fp64."""
    parts = [torch.linalg.vector_norm(p, ord, dtype=torch.float64) for p in pieces if p.numel()]
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=pieces[0].device if pieces else None)
    norms = torch.stack(parts)
    return norms.amax() if math.isinf(ord) else norms.pow(ord).sum()


class PartialNorm(Tensor):
    """A norm (0-dim, or 1-D after ``torch.stack``) whose cross-rank reduction is pending.

    Made by the norms of ``ShardedGrad`` and ``VirtualGrad`` (``zeroshard/sharded_grad.py``), never
    directly. ``torch.stack`` of norms (others may be plain tensors: norms of unsharded gradients,
    counted once), ``.to(device)`` and a norm of the stack with the same ``ord`` stay pending; any
    other use resolves the value (one collective, then cached) and runs on plain tensors.

    Attributes:
        local: fp64, this tensor's shape: per element, this rank's ``sum |x| ** ord`` (``max |x|`` for inf).
        plain: fp64, same shape: per element, a norm that needs no reduction (a plain tensor stacked in), else 0.
        reduce: per element: whether ``local`` is summed over ranks when read alone (a ``VirtualGrad``'s is not).
        ord: the order of every pending element.
        comm: the group the pending elements reduce over.
    """

    local: Tensor
    plain: Tensor
    reduce: tuple[bool, ...]
    ord: float
    comm: GradComm
    _value: Tensor | None

    @staticmethod
    def make(local: Tensor, plain: Tensor, reduce: Sequence[bool], ord: float, comm: GradComm, dtype: torch.dtype, device: torch.device) -> PartialNorm:
        """A pending norm of ``dtype`` on ``device``, shaped like ``local``."""
        out = Tensor._make_subclass(PartialNorm, torch.full(local.shape, math.nan, dtype=dtype, device=device))
        out.local, out.plain, out.reduce, out.ord, out.comm, out._value = local, plain, tuple(reduce), ord, comm, None
        return out

    def resolve(self) -> Tensor:
        """The norm's value as a plain tensor (reduced over the ranks once; cached).

        Raises:
            RuntimeError: with ``collective_timeout_s``, a rank did not join the reduction in time.
        """
        if self._value is None:
            local = self.local
            mask = torch.tensor(self.reduce, dtype=torch.bool, device=local.device).reshape(local.shape)
            if any(self.reduce):
                what = "reading a gradient norm (its reduction over the ranks)"
                reduced = self.comm.max(local.clone(), what) if math.isinf(self.ord) else self.comm.sum_(local.clone(), what)
                local = torch.where(mask, reduced, local)
            if math.isinf(self.ord):
                value = torch.maximum(local, self.plain)
            else:
                value = (local + self.plain.pow(self.ord)).pow(1.0 / self.ord)
            with torch._C.DisableTorchFunctionSubclass():
                self._value = value.to(device=self.device, dtype=self.dtype)
                self.copy_(self._value)  # reads that bypass torch functions see the value too
        return self._value

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"PartialNorm({self.resolve()!r})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__" or name in ("dim", "size", "numel", "is_floating_point", "element_size", "__len__"):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if name == "stack" and _stackable(args, kwargs):
            return _stack(args[0])
        if name in ("to", "cpu", "cuda") and isinstance(args[0], PartialNorm):
            moved = _moved(args[0], func, args[1:], kwargs)
            if moved is not None:
                return moved
        if name in ("linalg_vector_norm", "norm", "linalg_norm") and isinstance(args[0], PartialNorm):
            total = _aggregate(args[0], args[1:], kwargs)
            if total is not None:
                return total
        return _run_resolved(func, args, kwargs)


def _resolved(value: Any) -> Any:
    if isinstance(value, PartialNorm):
        return value.resolve()
    if isinstance(value, (list, tuple)):
        return type(value)(_resolved(v) for v in value)
    return value


def _run_resolved(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        return func(*_resolved(args), **{k: _resolved(v) for k, v in kwargs.items()})


def _stackable(args: Any, kwargs: dict[str, Any]) -> bool:
    tensors = args[0] if args else None
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    if not isinstance(tensors, (list, tuple)) or dim != 0 or "out" in kwargs:
        return False
    partial = [t for t in tensors if isinstance(t, PartialNorm)]
    return all(t.dim() == 0 for t in tensors) and len({t.ord for t in partial}) == 1 and len({id(t.comm.group) for t in partial}) == 1


def _stack(tensors: Sequence[Tensor]) -> PartialNorm:
    first = next(t for t in tensors if isinstance(t, PartialNorm))
    with torch._C.DisableTorchFunctionSubclass():
        zero = torch.zeros((), dtype=torch.float64, device=first.local.device)
        local = torch.stack([t.local if isinstance(t, PartialNorm) else zero for t in tensors])
        plain = torch.stack([t.plain if isinstance(t, PartialNorm) else t.detach().to(first.local.device, torch.float64) for t in tensors])
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in tensors])
    reduce = [t.reduce[0] if isinstance(t, PartialNorm) else False for t in tensors]
    return PartialNorm.make(local, plain, reduce, first.ord, first.comm, dtype, first.device)


def _moved(norm: PartialNorm, func: Any, args: Any, kwargs: dict[str, Any]) -> PartialNorm | None:
    """``norm.to(device)`` still pending; ``None`` for any other conversion (a dtype: resolved first)."""
    with torch._C.DisableTorchFunctionSubclass():
        probe = func(torch.empty(0, dtype=norm.dtype, device=norm.device), *args, **kwargs)
    if probe.dtype != norm.dtype:
        return None
    if probe.device == norm.device:
        return norm
    return PartialNorm.make(norm.local, norm.plain, norm.reduce, norm.ord, norm.comm, norm.dtype, probe.device)


def _aggregate(norms: PartialNorm, args: Any, kwargs: dict[str, Any]) -> PartialNorm | None:
    """The norm of a stack of norms, still pending: its parts summed (maxed), reduced when read; ``None`` if not that."""
    ord = kwargs.get("ord", kwargs.get("p", args[0] if args else 2.0))
    if kwargs.get("dim", args[1] if len(args) > 1 else None) is not None or kwargs.get("dtype") is not None or kwargs.get("out") is not None:
        return None
    try:
        if norm_order(ord) != norms.ord:
            raise ValueError
    except ValueError:
        if not all(norms.reduce):
            raise ValueError(f"the norm (ord={ord!r}) of norms of a ShardedOptimizer's param_groups gradients (ord={norms.ord}) cannot be "
                             "reduced over the ranks: take both norms with the same ord") from None
        return None
    if math.isinf(norms.ord):
        local, plain = norms.local.amax(), norms.plain.amax()
    else:
        local, plain = norms.local.sum(), norms.plain.pow(norms.ord).sum().pow(1.0 / norms.ord)
    return PartialNorm.make(local.reshape(()), plain.reshape(()), [True], norms.ord, norms.comm, norms.dtype, norms.device)
