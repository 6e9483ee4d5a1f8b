"""Gradient norms whose cross-rank reduction waits until a value is read: ``PartialNorm``.

A ``PartialNorm`` keeps this rank's sum of ``|x| ** ord`` (the largest ``|x|`` for ``inf``) through ``torch.stack``,
``.to(device)`` and the outer norm of ``torch.nn.utils.clip_grad_norm_``, and reduces over the shard group at the first read
of a value, so a whole clip costs one all-reduce, as FSDP2's DTensor norms with a partial placement do
(``torch/distributed/tensor/_ops/_math_ops.py``). What the norms mean and which reads are collectives: docs/design.md,
"Gradients that user code reads".
"""

from __future__ import annotations

import datetime
import functools
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from zeroshard.comm import collectives
from zeroshard.compat import DisableTorchFunctionSubclass, make_subclass

_HINT = "read the same gradient values alike (a norm, a clip or full_tensor() of a param's .grad is a collective over the data-parallel ranks)"


@dataclass(frozen=True)
class GradComm:
    """Where the pieces of one optimizer's gradients are: its shard group (every replica's grad shards are the same), and the bound on each wait."""

    group: ProcessGroup
    timeout: datetime.timedelta | None
    reduce_pending: Callable[[], object] = lambda: None  # before a virtual param's .grad is used: reduce what is still local

    @property
    def size(self) -> int:
        """The number of ranks the pieces are spread over."""
        return dist.get_world_size(self.group)

    def sum_(self, tensor: Tensor, what: str) -> Tensor:
        """All-reduce ``tensor`` in place (SUM) over the group and return it (no collective for a group of one); a timeout raises naming ``what``."""
        if self.size > 1:
            collectives.wait(collectives.all_reduce(tensor, self.group), self.timeout, what, _HINT)
        return tensor

    def max(self, tensor: Tensor, what: str) -> Tensor:
        """Elementwise maximum of ``tensor`` over the group, NaN-propagating (gloo's MAX drops a NaN unless rank 0 holds it); as :meth:`sum_`."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        collectives.wait(dist.all_gather(parts, tensor, group=self.group, async_op=True), self.timeout, what, _HINT)
        return torch.stack(parts).amax(dim=0)


def param_tag(name: str) -> int:
    """A number in [1, 2**16] naming param ``name`` alike on every rank (``hash`` of a str differs per process)."""
    return zlib.crc32(name.encode()) % (1 << 16) + 1


def norm_order(ord: Any) -> float:
    """``ord`` of a vector norm as a float (``"fro"`` is 2); ``ValueError`` for an order whose parts cannot be summed over ranks
    (``<= 0``, ``-inf``, a string other than ``"fro"``)."""
    value = 2.0 if ord is None or ord == "fro" else ord
    if isinstance(value, str) or not float(value) > 0:
        raise ValueError(f"ord={ord!r}: a norm of a sharded gradient takes a positive order or inf (its parts are summed over ranks)")
    return float(value)


NORMS = frozenset({"linalg_vector_norm", "norm", "linalg_norm"})  # linalg_norm: only ord=None / "fro" (of a matrix: Frobenius)


def norm_arguments(args: Any, kwargs: dict[str, Any]) -> tuple[Any, Any, torch.dtype | None]:
    """``(ord, dim, dtype)`` of ``vector_norm(x, ord, dim, keepdim, dtype=)``, ``norm(x, p, dim, keepdim, dtype=)`` or ``Tensor.norm``."""
    ord = kwargs.get("ord", kwargs.get("p", args[0] if args else 2.0))
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    return ord, dim, kwargs.get("dtype")


def local_power_sum(pieces: Sequence[Tensor], ord: float) -> Tensor:
    """This rank's part of a norm: ``sum |x| ** ord`` over ``pieces`` (``max |x|`` for ``inf``), 0-dim fp64."""
    parts = [torch.linalg.vector_norm(p, ord, dtype=torch.float64) for p in pieces if p.numel()]
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=pieces[0].device if pieces else None)
    norms = torch.stack(parts)
    return norms.amax() if math.isinf(ord) else norms.pow(ord).sum()


SHARDED, VIRTUAL, PLAIN = "sharded", "virtual", "plain"  # what one element of a PartialNorm is the norm of


@dataclass(eq=False)
class ParamSpace:
    """The params of one ``ShardedOptimizer`` as its ``torch.optim`` indices number them: ``size`` of them (grows with ``add_param_group``)."""

    size: int = 0


class PartialNorm(Tensor):
    """A norm (0-dim, or 1-D after ``torch.stack``) whose cross-rank reduction is pending.

    Made by the norms of ``ShardedGrad`` and ``VirtualGrad`` (``sharded_grad.py``). Each element is the norm of one gradient:
    a ``ShardedGrad``'s (:data:`SHARDED`: its power sum is summed over the ranks when read), a ``VirtualGrad``'s
    (:data:`VIRTUAL`: local when read alone) or a plain tensor stacked in (:data:`PLAIN`: counted once). ``torch.stack`` of
    0-dim norms, ``.to(device)`` and a norm of a stack with the same ``ord`` (an *aggregate*) stay pending; any other use
    resolves the value (one collective, then cached) and runs on plain tensors. An aggregate is resolved as torch computes it
    over DDP's gradients: each gradient's norm, exact (fp64 power sums), rounded to the norm's dtype, then
    ``torch.linalg.vector_norm`` of those in stack order (the ``VirtualGrad`` s' gathered per param first, after the others).
    """

    local: Tensor  # fp64, one per element: this rank's ``sum |x| ** ord`` (``max |x|`` for inf); 0 for plain ones
    plain: Tensor  # fp64, one per element: a plain element's norm; 0 for the others
    kinds: tuple[str, ...]  # per element, SHARDED, VIRTUAL or PLAIN
    slots: tuple[int, ...]  # per virtual element, its param's index in its optimizer (else -1)
    spaces: tuple[ParamSpace | None, ...]  # per virtual element, that optimizer's ParamSpace (else None)
    aggregate: bool  # whether this 0-dim tensor is the norm of its elements (else it is the elements themselves)
    ord: float  # the order of every pending element
    comm: GradComm  # the group the pending elements reduce over
    # per element, its norm's dtype before torch.stack promoted them (each is rounded to its own first, as torch's stack of DDP's norms)
    dtypes: tuple[torch.dtype, ...]
    exact: tuple[bool, ...]  # per element: its ``local`` is the norm itself, taken by the one rank that holds the whole gradient (0 on the others)
    tags: tuple[int, ...]  # per element, its param's :func:`param_tag` (sharded elements), else 0
    _value: Tensor | None  # the resolved value, once read

    @staticmethod
    def make(local: Tensor, plain: Tensor, kinds: Sequence[str], ord: float, comm: GradComm, dtype: torch.dtype, device: torch.device,
             *, shape: Sequence[int] = (), aggregate: bool = False, slots: Sequence[int] = (-1,),
             spaces: Sequence[ParamSpace | None] = (None,), dtypes: Sequence[torch.dtype] = (), exact: Sequence[bool] = (),
             tags: Sequence[int] = ()) -> PartialNorm:
        """A pending norm of ``dtype`` on ``device``, of ``shape`` (the attributes, ``dtypes`` by default all ``dtype``)."""
        out = make_subclass(PartialNorm, torch.full(tuple(shape), math.nan, dtype=dtype, device=device))
        out.local, out.plain, out.kinds, out.aggregate, out.ord, out.comm, out._value = local, plain, tuple(kinds), aggregate, ord, comm, None
        out.slots, out.spaces, out.dtypes = tuple(slots), tuple(spaces), tuple(dtypes) or (dtype,) * len(out.kinds)
        out.exact = tuple(exact) or (False,) * len(out.kinds)
        out.tags = tuple(tags) or (0,) * len(out.kinds)
        return out

    def _like(self, **changes: Any) -> PartialNorm:
        """This pending norm with some of :meth:`make`'s arguments changed."""
        args: dict[str, Any] = dict(shape=self.shape, aggregate=self.aggregate, slots=self.slots, spaces=self.spaces, dtype=self.dtype,
                                    device=self.device, dtypes=self.dtypes, exact=self.exact, tags=self.tags)
        args.update(changes)
        return PartialNorm.make(self.local, self.plain, self.kinds, self.ord, self.comm, **args)

    def resolve(self) -> Tensor:
        """The norm's value as a plain tensor (reduced over the ranks once; cached).

        Raises:
            RuntimeError: with ``collective_timeout_s``, a rank did not join the reduction in time.
        """
        if self._value is None:
            value = self._aggregate_value() if self.aggregate else self._element_values()
            with DisableTorchFunctionSubclass():
                self._value = value.to(device=self.device, dtype=self.dtype).reshape(self.shape)
                self.copy_(self._value)  # reads that bypass torch functions see the value too
        return self._value

    def _root(self, power_sums: Tensor) -> Tensor:
        return power_sums if math.isinf(self.ord) else power_sums.pow(1.0 / self.ord)

    def _reduce(self, vector: Tensor, sharded: list[int]) -> Tensor:
        """``vector`` (fp64) reduced over the ranks. On the CPU, or with ``collective_timeout_s`` (the host waits anyway), it carries
        the sum ``t`` of the ``sharded`` elements' tags and ``t**2`` (``-t`` for inf): all ranks reduced the same params' norms
        exactly when the results are ``n*t`` and ``n*t**2``; and, for an aggregate, the sum ``p`` of the plain elements' norms and
        ``p**2`` (``-p``): those are alike on every rank (DDP's averaged gradients) when ``n*sum(p**2)`` is ``sum(p)**2`` (per-element
        norms are each gradient's own, plain ones too). Else every rank raises ``RuntimeError``, where the values would be wrong."""
        what, inf = "reading a gradient norm (its reduction over the ranks)", math.isinf(self.ord)
        if self.comm.size == 1 or (vector.device.type != "cpu" and self.comm.timeout is None):
            return self.comm.max(vector, what) if inf else self.comm.sum_(vector, what)
        tag = float(sum(self.tags[i] for i in sharded) % (1 << 20))  # exact in fp64 with its square, summed over 4096 ranks
        plain = self.plain.index_select(0, copy_to_device([i for i, kind in enumerate(self.kinds) if kind == PLAIN and self.aggregate],
                                                          vector.device)).sum()
        checks = [torch.tensor([tag, -tag if inf else tag * tag], dtype=vector.dtype).to(vector.device), torch.stack([plain, -plain if inf else plain * plain])]
        vector = torch.cat([vector, *checks])
        vector = self.comm.max(vector, what) if inf else self.comm.sum_(vector, what)
        n = 1 if inf else self.comm.size
        tags, plains = vector[-4:-2].tolist(), vector[-2:].tolist()
        if tags != [n * tag, -tag if inf else n * tag * tag]:
            raise RuntimeError(f"{what}: the ranks reduced the norms of different params' gradients together, so the values would be "
                               "wrong; read per-param norms in the same order on every rank (model.parameters(), not a set), and on "
                               "every rank (not on rank 0 only)")
        # 0 when alike on every rank, up to rounding: max - min of p (inf), else n * sum(p**2) - sum(p)**2
        spread, scale = (plains[0] + plains[1], plains[0]) if inf else (self.comm.size * plains[1] - plains[0] ** 2, plains[0] ** 2)
        if spread > 1e-9 * scale:
            raise RuntimeError(f"{what}: it includes gradients that are plain tensors, of params no ShardedOptimizer holds, and they differ "
                               "between the ranks (DDP would have averaged them; each rank's are its own), so each rank would get another "
                               "norm and clip by another factor; put those params in a ShardedOptimizer, or freeze them, before the backward "
                               "(docs/integrations.md, \"From ZeroRedundancyOptimizer\")")
        return vector[:-4]

    def _norms(self, sharded: list[int], reduced: Tensor) -> Tensor:
        """Per element its norm (fp64) rounded to its own dtype: ``sharded`` ones from their ``reduced`` power sums, plain as given, virtual local."""
        device = self.local.device
        norms = self._root(self.local.clone())
        if sharded:  # an exact one's reduced value is the norm itself
            exact = copy_to_device([self.exact[i] for i in sharded], device, torch.bool)
            norms.index_copy_(0, copy_to_device(sharded, device), torch.where(exact, reduced, self._root(reduced)))
        if plain := [i for i, kind in enumerate(self.kinds) if kind == PLAIN]:
            index = copy_to_device(plain, device)
            norms.index_copy_(0, index, self.plain.index_select(0, index))
        for dtype in set(self.dtypes) - {torch.float64}:  # a bf16 gradient's norm is a bf16 number, also in an fp32 stack
            own = copy_to_device([i for i, d in enumerate(self.dtypes) if d == dtype], device)
            norms.index_copy_(0, own, norms.index_select(0, own).to(dtype).to(torch.float64))
        return norms

    def _element_values(self) -> Tensor:
        """Per element its norm: sharded ones reduced over the ranks (one collective), virtual ones local (a virtual param's own)."""
        sharded = [i for i, kind in enumerate(self.kinds) if kind == SHARDED]
        local = self.local.index_select(0, copy_to_device(sharded, self.local.device))
        return self._norms(sharded, self._reduce(local, sharded) if sharded else local)

    def _aggregate_value(self) -> Tensor:
        """The norm of the elements, as ``torch.linalg.vector_norm`` of DDP's per-param norms computes it (one collective).

        Virtual elements (this rank's pieces of params) are summed per param (``VirtualGrad.slot``) into a vector of the same
        length on every rank, reduced with the sharded ones and a count of pieces per param, then rounded to the norm's dtype
        per param as DDP's are. Virtual elements of several optimizers are summed into one entry instead.
        """
        sharded = [i for i, kind in enumerate(self.kinds) if kind == SHARDED]
        virtual = [i for i, kind in enumerate(self.kinds) if kind == VIRTUAL]
        spaces = {id(space): space for i, space in enumerate(self.spaces) if i in virtual and space is not None}
        one = len(spaces) == 1
        size = next(iter(spaces.values())).size if one else 1
        device = self.local.device
        slots = copy_to_device([self.slots[i] if one else 0 for i in virtual], device)
        zeros = torch.zeros(size, dtype=torch.float64, device=device)
        per_param = zeros.scatter_reduce(0, slots, self.local.index_select(0, copy_to_device(virtual, device)), "amax" if math.isinf(self.ord) else "sum")
        pieces = zeros.index_add(0, slots, torch.ones(len(virtual), dtype=torch.float64, device=device))
        vector = torch.cat([self.local.index_select(0, copy_to_device(sharded, device)), per_param, pieces])
        if sharded or virtual:
            vector = self._reduce(vector, sharded)
        per_param, pieces = vector[len(sharded) : len(sharded) + size], vector[len(sharded) + size :]
        kept = self._norms(sharded, vector[: len(sharded)]).index_select(0, copy_to_device([i for i in range(len(self.kinds)) if i not in virtual], device))
        # A param no rank has a piece of here (a norm of some of the optimizer's params) counts as 0: no host sync to drop it.
        # Where every param is here (the model's params, or all param_groups on every rank) that is the norm of DDP's norms to
        # the bit; with some left out, the zeros change only how the sum is grouped (its rounding).
        roots = torch.where(pieces > 0, self._root(per_param), 0.0) if virtual else per_param[:0]
        values = torch.cat([kept, roots])
        with DisableTorchFunctionSubclass():
            return torch.linalg.vector_norm(values.to(self.dtype), self.ord)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"PartialNorm({self.resolve()!r})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__" or name in ("dim", "size", "numel", "is_floating_point", "element_size", "__len__"):
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if name == "stack" and _stackable(args, kwargs):
            return _stack(args[0])
        if name in ("to", "cpu", "cuda") and isinstance(args[0], PartialNorm) and (moved := _moved(args[0], func, args[1:], kwargs)) is not None:
            return moved
        if name in NORMS and isinstance(args[0], PartialNorm) and (total := _aggregate(args[0], args[1:], kwargs)) is not None:
            return total
        with DisableTorchFunctionSubclass():
            return func(*_resolved(args), **{k: _resolved(v) for k, v in kwargs.items()})


def copy_to_device(values: Sequence[int] | Sequence[bool], device: torch.device, dtype: torch.dtype = torch.long) -> Tensor:
    """Host ``values`` (indices or flags) as a 1-D ``dtype`` tensor on ``device``, on CUDA copied from pinned memory without
    blocking: the host does not wait for the device (a pageable copy, or an index list in ``t[list]``, would)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _resolved(value: Any) -> Any:
    if isinstance(value, PartialNorm):
        return value.resolve()
    if isinstance(value, (list, tuple)):
        return type(value)(_resolved(v) for v in value)
    return value


def _stackable(args: Any, kwargs: dict[str, Any]) -> bool:
    """``torch.stack`` of 0-dim norms along dim 0, the pending ones single norms of one ord and group."""
    tensors = args[0] if args else None
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    if not isinstance(tensors, (list, tuple)) or dim != 0 or "out" in kwargs:
        return False
    partial = [t for t in tensors if isinstance(t, PartialNorm)]
    return (all(t.dim() == 0 for t in tensors) and not any(t.aggregate for t in partial) and len({t.ord for t in partial}) == 1
            and len({id(t.comm.group) for t in partial}) == 1)


def _stack(tensors: Sequence[Tensor]) -> PartialNorm:
    first = next(t for t in tensors if isinstance(t, PartialNorm))
    device = first.local.device
    with DisableTorchFunctionSubclass():
        zero = torch.zeros(1, dtype=torch.float64, device=device)
        local = torch.cat([t.local if isinstance(t, PartialNorm) else zero for t in tensors])
        plain = torch.cat([t.plain if isinstance(t, PartialNorm) else t.detach().to(device, torch.float64).reshape(1) for t in tensors])
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in tensors])
    kinds, slots, spaces, exact, tags = zip(*[(t.kinds[0], t.slots[0], t.spaces[0], t.exact[0], t.tags[0]) if isinstance(t, PartialNorm)
                                              else (PLAIN, -1, None, False, 0) for t in tensors])
    return PartialNorm.make(local, plain, kinds, first.ord, first.comm, dtype, first.device, shape=(len(tensors),), slots=slots, spaces=spaces,
                            dtypes=[t.dtype for t in tensors], exact=exact, tags=tags)


def _moved(norm: PartialNorm, func: Any, args: Any, kwargs: dict[str, Any]) -> PartialNorm | None:
    """``norm.to(device)`` still pending; ``None`` for any other conversion (a dtype: resolved first)."""
    with DisableTorchFunctionSubclass():
        probe = func(torch.empty(0, dtype=norm.dtype, device=norm.device), *args, **kwargs)
    if probe.dtype != norm.dtype:
        return None
    return norm if probe.device == norm.device else norm._like(device=probe.device)


def _aggregate(norms: PartialNorm, args: Any, kwargs: dict[str, Any]) -> PartialNorm | None:
    """The norm of a stack of norms (same ``ord``), still pending; ``None`` if the call is not that. Another ``ord`` over norms of
    ``VirtualGrad`` s, which cannot be combined across ranks, raises ``ValueError``."""
    ord, dim, dtype = norm_arguments(args, kwargs)
    if norms.aggregate or dim is not None or dtype is not None or kwargs.get("out") is not None:
        return None
    try:
        same = norm_order(ord) == norms.ord
    except ValueError:
        same = False
    if not same:
        if VIRTUAL in norms.kinds:
            raise ValueError(f"the norm (ord={ord!r}) of norms of a ShardedOptimizer's param_groups gradients (ord={norms.ord}) cannot be "
                             "reduced over the ranks: take both norms with the same ord")
        return None
    return norms._like(shape=(), aggregate=True)
