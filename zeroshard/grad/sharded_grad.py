"""The ``.grad`` user code reads once zeroshard has reduced a backward: ``ShardedGrad`` and ``VirtualGrad``.

What each answers to torch's gradient code, and which calls are collectives: docs/design.md, "Gradients that user code
reads". See [Note: zeroshard buffers] in ``zeroshard/layout/flat_buffer.py`` for the grad shard.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import Tensor, nn

from zeroshard.compat import DisableTorchFunctionSubclass, compiling, current_graph_task, foreach_norm, make_subclass
from zeroshard.grad.gathered_view import first_argument, views_refuse_edits, writes_first_argument
from zeroshard.grad.partial_norm import NORMS, SHARDED, VIRTUAL, GradComm, ParamSpace, PartialNorm, local_power_sum, norm_arguments, norm_order, param_tag

if TYPE_CHECKING:
    from zeroshard.grad.amp import GradScalerLink
    from zeroshard.layout.local_shard import LocalShard
    from zeroshard.layout.partition import ShardPiece


class GradHome(Protocol):
    """What a ``ShardedGrad`` reads of the record that made it (:class:`~zeroshard.grad.shard_grads.ShardGrads`)."""

    shard: LocalShard  # whose grad shard holds the reduced gradient
    live: bool  # False once the optimizer stepped (or was closed): the gradient is stale
    pieces_of: list[list[tuple[int, Tensor]]]  # per param, its pieces on this rank: (offset in the flattened param, grad shard view)
    whole: list[bool]  # per param, whether this rank holds it whole
    comm: GradComm  # where the other ranks' pieces are
    edited: bool  # set when user code writes a ShardedGrad in place
    reductions: int  # how many reductions left gradients here (a ShardedGrad zeroed after the last one reads as zeros)
    shard_version: int  # the grad shard's version when zeroshard last wrote it
    arrivals: list[int]  # per param, the gradients taken in the running backward pass

# Torch functions that read only metadata, or that nn.Module.zero_grad and printing call.
_METADATA = frozenset({
    "__set__", "size", "dim", "numel", "nelement", "stride", "element_size", "is_floating_point", "is_complex",
    "requires_grad_", "detach_", "_is_view", "_has_compatible_shallow_copy_type", "data_ptr", "storage_offset", "__len__",
    "get_device", "is_sparse", "is_pinned", "is_conj", "is_neg", "is_inference",
})
_SET_DATA = Tensor.data.__set__  # type: ignore[attr-defined]
_METADATA_OR_GET = _METADATA | {"__get__"}  # VirtualGrad: property reads, too, need no gradient piece
# Properties that return a tensor: these would read the expanded placeholder's values.
_VALUE_PROPERTIES = frozenset({"T", "mT", "H", "mH", "real", "imag"})
_CONVERSIONS = frozenset({"to", "cpu", "cuda", "float", "double", "half", "bfloat16", "type", "type_as"})
# Elementwise in-place functions done on this rank's pieces (other tensor arguments: scalars or the param's shape).
_INPLACE = frozenset({
    "mul_", "div_", "clamp_", "clamp_min_", "clamp_max_", "clip_", "zero_", "nan_to_num_", "fill_", "add_", "sub_", "copy_",
    "neg_", "abs_", "sign_", "sqrt_", "pow_", "addcmul_", "addcdiv_", "lerp_", "__imul__", "__itruediv__", "__iadd__", "__isub__",
})
_FOREACH_INPLACE = frozenset({
    "_foreach_mul_", "_foreach_div_", "_foreach_clamp_min_", "_foreach_clamp_max_", "_foreach_zero_", "_foreach_add_",
    "_foreach_sub_", "_foreach_neg_", "_foreach_abs_", "_foreach_sqrt_", "_foreach_pow_", "_foreach_lerp_", "_foreach_copy_",
    "_foreach_maximum_", "_foreach_minimum_", "_foreach_addcmul_", "_foreach_addcdiv_", "_foreach_sign_",
})


def _disabled(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


class ShardedGrad(Tensor):
    """A model param's ``.grad`` after zeroshard reduced it: DDP's averaged gradient, held as pieces across the ranks.

    Shape and dtype of the param, one element of storage (stride 0, NaN). Made once per param by
    :meth:`zeroshard.grad.shard_grads.ShardGrads.sharded_grad` and reused.
    """

    home: GradHome  # the reducer's record of the shard
    param_index: int  # the param's index in its flat buffer (layout order)
    placeholder: int  # the data pointer of its one element: ``Tensor.set_`` (which no torch function sees) changes it
    zeroed_at: int = -1  # ``home.reductions`` when it was zeroed after ``step()`` consumed it (``zero_grad(set_to_none=False)``)

    @property
    def param_name(self) -> str:
        """How errors name the param: ``param_groups[g]['params'][j]``."""
        return self.home.shard.buffer.names[self.param_index]

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # no values: printing is not a collective
        state = "zeroed after step()" if self.zeroed else "consumed by step()" if self.consumed else "reduced"
        return f"ShardedGrad({self.param_name}, shape={tuple(self.shape)}, dtype={self.dtype}, {state}; .full_tensor() gathers it)"

    @property
    def consumed(self) -> bool:
        """Whether ``step()`` used this gradient since it was reduced (its values are gone)."""
        return not self.home.live

    @property
    def zeroed(self) -> bool:
        """Whether it was zeroed after ``step()`` consumed it: it then reads as zeros, with no collective, as DDP's zeroed ``.grad``."""
        return self.zeroed_at == self.home.reductions and not self.home.live

    def local_pieces(self) -> list[tuple[int, Tensor]]:
        """This rank's pieces: ``(offset in the flattened param, 1-D view of the grad shard)`` each (master dtype)."""
        return self.home.pieces_of[self.param_index]

    def _check_live(self, what: str) -> None:
        if not self.consumed:
            return
        if current_graph_task() != -1 and self.home.arrivals[self.param_index]:  # zeroshard's hook took it in this backward
            raise RuntimeError(f"{self.param_name}: torch.{what} was called on its gradient inside backward, after zeroshard took it for "
                               "its bucket's reduce-scatter (by a hook that runs after zeroshard's: a grad accumulator's node hook, or "
                               "another param's hook), where DDP reduces it without a write; read or edit it in a post-accumulate-grad hook on the "
                               "param itself, or between backward and step()")
        raise RuntimeError(f"{self.param_name}: its gradient was consumed by ShardedOptimizer.step() (torch.{what} was called on it); "
                           "read or edit gradients between backward and step(), as the clip before step() does")

    @torch.no_grad()
    def full_tensor(self) -> Tensor:
        """The whole averaged gradient as a plain tensor of the param's shape and dtype (DTensor's name).

        A collective over the shard group, to call on every rank: one all-reduce of the param's size (each rank adds its pieces into zeros).

        Raises:
            RuntimeError: the gradient was consumed by ``step()``; with ``collective_timeout_s``, a rank did not join in time.
        """
        if self.zeroed:
            return torch.zeros(tuple(self.shape), dtype=self.dtype, device=self.device)
        self._check_live("full_tensor")
        grad_shard = self.home.shard.grad_shard
        full = torch.zeros(self.numel(), dtype=grad_shard.dtype, device=grad_shard.device)
        for offset, piece in self.local_pieces():
            full[offset : offset + piece.numel()] = piece
        self.home.comm.sum_(full, f"{self.param_name}: gathering its gradient (full_tensor(), or a torch function reading its values)")
        return _disabled(full.view, tuple(self.shape)).to(self.dtype)

    def _norm(self, ord: float, dtype: torch.dtype | None, foreach: bool = False) -> Tensor:
        """This gradient's norm, pending. A param whole in one rank's slice gets the norm torch computes of DDP's gradient
        there (``vector_norm`` or, for ``foreach``, ``_foreach_norm`` of it in the param dtype; 0 on the other ranks), so a
        clip sees DDP's numbers bit for bit; a param spread over slices, this rank's power sum of its pieces. Zeroed after
        ``step()``: a plain 0 (no collective)."""
        if self.zeroed:
            return torch.zeros((), dtype=dtype or self.dtype, device=self.device)
        self._check_live("norm")
        pieces = [piece for _, piece in self.local_pieces()]
        exact = self.home.whole[self.param_index]
        if not exact:
            local = local_power_sum(pieces or [self.home.shard.grad_shard[:0]], ord).reshape(1)
        else:
            local = torch.zeros(1, dtype=torch.float64, device=self.home.shard.grad_shard.device)
            if pieces:  # this rank holds the whole gradient (values of the param dtype: reduced in it)
                whole = pieces[0].view(tuple(self.shape)).to(self.dtype)
                with DisableTorchFunctionSubclass():
                    value = foreach_norm([whole], ord, dtype=dtype)[0] if foreach else torch.linalg.vector_norm(whole, ord, dtype=dtype)
                local[0] = value.to(torch.float64)
        return PartialNorm.make(local, torch.zeros_like(local), [SHARDED], ord, self.home.comm, dtype or self.dtype, self.device, exact=[exact],
                                tags=[param_tag(self.param_name)])

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__"):
            prop = getattr(getattr(func, "__self__", None), "__name__", "")
            if prop == "data" and isinstance(args[0], ShardedGrad):  # .data is the gradient itself; .data = t writes t's values
                if name == "__get__" or args[1] is args[0]:  # nn.Module._apply sets grad.data to what .to() returned: itself
                    return args[0] if name == "__get__" else None
                return args[0]._edit(Tensor.copy_, "copy_", (args[1],), {})
            if prop not in _VALUE_PROPERTIES:
                return _disabled(func, *args, **kwargs)
        elif name == "is_contiguous":
            return True  # the gradient it stands for is (its one-element placeholder is not)
        elif name in _METADATA or (name == "type" and len(args) == 1 and not kwargs) or (name == "untyped_storage" and compiling()):
            return _disabled(func, *args, **kwargs)
        out = kwargs.get("out")
        if isinstance(out, ShardedGrad):  # torch.mul(g, 0.5, out=g): computed on the gathered values, written into the pieces
            result = _disabled(func, *_gathered(args), **{k: _gathered(v) for k, v in kwargs.items() if k != "out"})
            return out._edit(Tensor.copy_, "copy_", (result,), {})
        self = args[0] if args and isinstance(args[0], ShardedGrad) else None
        if self is not None:
            if name == "detach" or (name in _CONVERSIONS and _converts_to_itself(self, func, args[1:], kwargs)):
                return self
            if name in NORMS:
                ord, dim, dtype = norm_arguments(args[1:], kwargs)
                if dim is None and not kwargs.get("keepdim", args[3] if len(args) > 3 else False) and _vector_norm(name, ord, self):
                    return self._norm(norm_order(ord), dtype)
            elif name in _INPLACE:
                return self._edit(func, name, args[1:], kwargs)
        if name == "_foreach_norm" and args:
            return _foreach_norm(args[0], *args[1:], **kwargs)
        if name == "_foreach_zero_" and args:  # as Tensor.zero_ on each (also zeroes a gradient step() consumed)
            for t in args[0]:
                if isinstance(t, ShardedGrad):
                    t._edit(Tensor.zero_, "zero_", (), {})
                else:
                    _disabled(Tensor.zero_, t)
            return None
        if name in _FOREACH_INPLACE and args:
            _foreach_edit(func, args[0], args[1:], kwargs)
            return None
        written = next((t for t in first_argument(args) if isinstance(t, ShardedGrad)), None)  # the gradient, or one in a list
        if written is not None and writes_first_argument(func, name):
            if getattr(func, "__module__", "").startswith("torch.distributed"):
                raise RuntimeError(f"{written.param_name}: torch.distributed.{name} on its gradient, which zeroshard has already reduced over "
                                   "the ranks (DDP's averaged gradient): drop a manual all-reduce and its division, as with DDP, or pass "
                                   "p.grad.full_tensor()")
            raise RuntimeError(f"{written.param_name}: torch.{name} cannot edit a gradient held as pieces on several ranks (ZeRO); "
                               "elementwise edits (mul_, div_, clamp_, add_, copy_, zero_, nan_to_num_, their _foreach forms) work, "
                               "or gather it with p.grad.full_tensor()")
        gathered = _gathered(args)
        return views_refuse_edits(_disabled(func, *gathered, **{k: _gathered(v) for k, v in kwargs.items()}), args, gathered)

    def _edit(self, func: Any, name: str, args: Any, kwargs: dict[str, Any]) -> ShardedGrad:
        """An elementwise in-place function on this rank's pieces (``zero_`` also moves the version: the reducer follows it)."""
        if name == "zero_":
            if not self.consumed:
                clean = self.home.shard_version == self.home.shard.grad_shard._version  # no edit since zeroshard's write
                for _, piece in self.local_pieces():
                    piece.zero_()
                if clean:  # zeroing is followed, not refused
                    self.home.shard_version = self.home.shard.grad_shard._version
            else:
                self.zeroed_at = self.home.reductions
            _disabled(Tensor.fill_, self, math.nan)  # moves the version, which the reducer reads (settle)
            return self
        args, kwargs = _gathered(args, self), {k: _gathered(v, self) for k, v in kwargs.items()}  # on every rank alike
        if self.zeroed:  # an edit that leaves zeros (a clip's multiply by 1.0) keeps them; any other raises
            probe = torch.zeros(tuple(self.shape), dtype=self.dtype, device=self.device)
            _disabled(func, probe, *args, **kwargs)
            _check_still_zero(self, probe, name)
            return self
        self._check_live(name)
        for offset, piece in self.local_pieces():
            n = piece.numel()
            _disabled(func, piece, *[_sliced(a, self, offset, n) for a in args], **{k: _sliced(v, self, offset, n) for k, v in kwargs.items()})
        self.home.edited = True
        return self


class VirtualGrad(Tensor):
    """A virtual param's ``.grad`` between steps: its piece of the grad shard, with norms reduced over the ranks when combined.

    Shares storage with the grad shard (1-D master dtype, or shaped like the param with ``partition="param"``): every torch
    function runs on it as on a plain tensor, except norms (:class:`~zeroshard.grad.partial_norm.PartialNorm`) and
    ``GradScaler.unscale_`` (unscaled in place; its ``found_inf`` flags get every rank's answer at ``step()``).
    """

    comm: GradComm  # where the other ranks' pieces are
    space: ParamSpace
    slot: int  # its param's torch.optim index in ``space``
    shard: LocalShard  # whose grad shard it is a piece of
    amp_link: GradScalerLink | None = None  # the optimizer's (zeroshard/grad/amp.py)
    elsewhere: str = ""  # the param's name when the piece is on another device (offload on CUDA)

    @staticmethod
    def of(shard: LocalShard, piece: ShardPiece, vparam: Tensor, comm: GradComm, space: ParamSpace) -> VirtualGrad:
        """A ``VirtualGrad`` for ``vparam``, sharing the storage of ``piece`` of ``shard``'s grad shard.

        A ``vparam`` in host memory (offload) with its piece on the GPU gets instead a placeholder on its own device (``.grad``
        must be on the param's) that refuses every torch function but metadata."""
        values = shard.grad_piece(piece, vparam.shape)
        if values.device == vparam.device:
            grad = make_subclass(VirtualGrad, values)
        else:
            grad = make_subclass(VirtualGrad, torch.zeros((), dtype=values.dtype, device=vparam.device).expand(values.shape))
            grad.elsewhere = shard.buffer.names[piece.param]
        grad.comm, grad.space, grad.slot, grad.shard = comm, space, shard.param_indices[piece.param], shard
        grad.amp_link = cast("GradScalerLink | None", shard.amp_link)
        return grad

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__set__" and func == _SET_DATA:  # grad.data = t moves it off the grad shard: step() follows (take_replaced_grads)
            args[0].shard.grads_moved = True
        if name in _METADATA_OR_GET:
            return _disabled(func, *args, **kwargs)
        grads = [g for a in args for g in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(g, VirtualGrad)]
        placeholder = next((g.elsewhere for g in grads if g.elsewhere), "")
        if placeholder:
            raise RuntimeError(f"{placeholder}: a virtual param in host memory (offload='cpu') has its gradient piece on the GPU, so torch.{name} "
                               "cannot run on its .grad; clip with ShardedOptimizer(..., max_grad_norm=...) or torch.nn.utils.clip_grad_norm_ "
                               "over the model's params")
        for comm in {id(g.comm): g.comm for g in grads}.values():
            comm.reduce_pending()  # what no_sync() left local: reduced first, on every rank alike
        if name in NORMS and args and isinstance(args[0], VirtualGrad):
            ord, dim, dtype = norm_arguments(args[1:], kwargs)
            if dim is None and _vector_norm(name, ord, args[0]):
                return _virtual_norm(args[0], norm_order(ord), dtype)
        if name == "_foreach_norm" and args:
            return _foreach_norm(args[0], *args[1:], **kwargs)
        if name == "_amp_foreach_non_finite_check_and_unscale_" and args:
            for link in {id(g.amp_link): g.amp_link for g in grads if g.amp_link is not None}.values():
                link.note_unscale(args[1])
        return _disabled(func, *args, **kwargs)


def _virtual_norm(grad: VirtualGrad, ord: float, dtype: torch.dtype | None) -> PartialNorm:
    local = _disabled(local_power_sum, [grad], ord).reshape(1)
    return PartialNorm.make(local, torch.zeros_like(local), [VIRTUAL], ord, grad.comm, dtype or grad.dtype, grad.device, slots=[grad.slot],
                            spaces=[grad.space])


def _foreach_norm(tensors: Sequence[Tensor], ord: Any = 2, dtype: torch.dtype | None = None) -> list[Tensor]:
    """``torch._foreach_norm`` over a mix of sharded, virtual and plain gradients: pending norms for the first two."""
    order = norm_order(ord)
    return [t._norm(order, dtype, foreach=True) if isinstance(t, ShardedGrad) else _virtual_norm(t, order, dtype) if isinstance(t, VirtualGrad)
            else _disabled(torch.linalg.vector_norm, t, ord, dtype=dtype) for t in tensors]


def _foreach_edit(func: Any, tensors: Sequence[Tensor], args: Any, kwargs: dict[str, Any]) -> None:
    """A ``torch._foreach_*_`` edit: each ``ShardedGrad`` replaced by its pieces, per-tensor arguments repeated or sliced alike."""
    targets: list[Tensor] = []
    name = getattr(func, "__name__", "_foreach edit")
    args = _gathered(args)  # another gradient as an argument: gathered once, on every rank
    lists = [a for a in args if isinstance(a, (list, tuple))]
    per_tensor: list[list[Any]] = [[] for _ in lists]
    zeroed = [j for j, t in enumerate(tensors) if isinstance(t, ShardedGrad) and t.zeroed]
    if zeroed:  # zeroed after step(): checked before anything is written, as in ShardedGrad._edit
        probes = [torch.zeros(tuple(tensors[j].shape), dtype=tensors[j].dtype, device=tensors[j].device) for j in zeroed]
        _disabled(func, probes, *[[a[j] for j in zeroed] if isinstance(a, (list, tuple)) else a for a in args], **kwargs)
        for j, probe in zip(zeroed, probes):
            _check_still_zero(cast(ShardedGrad, tensors[j]), probe, name)
    for j, t in enumerate(tensors):
        if j in zeroed:
            continue
        if isinstance(t, ShardedGrad):
            t._check_live(name)
            t.home.edited = True
            for offset, piece in t.local_pieces():
                targets.append(piece)
                for k, values in enumerate(lists):
                    per_tensor[k].append(_sliced(values[j], t, offset, piece.numel()))
        else:
            targets.append(t)
            for k, values in enumerate(lists):
                per_tensor[k].append(values[j])
    if not targets:
        return
    lists_left = iter(per_tensor)
    call_args = [next(lists_left) if isinstance(a, (list, tuple)) else a for a in args]
    _disabled(func, targets, *call_args, **kwargs)


def _check_still_zero(grad: ShardedGrad, probe: Tensor, name: str) -> None:
    """Raise ``RuntimeError`` unless ``probe`` (what an edit made of zeros) is all zeros: ``grad``, zeroed after ``step()``, holds no values."""
    if _disabled(probe.any):
        raise RuntimeError(f"{grad.param_name}: torch.{name} would give its gradient, zeroed after ShardedOptimizer.step() consumed it, "
                           "values other than zeros, which a gradient held as pieces on several ranks takes only from a backward")


def _sliced(value: Any, grad: ShardedGrad, offset: int, numel: int) -> Any:
    """An argument of an edit of ``grad``'s piece at ``offset``: a tensor of the param's shape sliced alike; anything else as is."""
    if isinstance(value, Tensor) and value.dim() > 0 and value.numel() > 1:
        if tuple(value.shape) != tuple(grad.shape):
            raise RuntimeError(f"{grad.param_name}: an in-place edit of its sharded gradient {tuple(grad.shape)} takes scalars or tensors of "
                               f"its shape, got {tuple(value.shape)}; gather it with p.grad.full_tensor() first")
        return _disabled(value.reshape, -1)[offset : offset + numel]
    return value


def _gathered(value: Any, edited: ShardedGrad | None = None) -> Any:
    """``value`` with every ``ShardedGrad`` (also inside lists) replaced by its gathered full tensor (a collective each); raises
    ``RuntimeError`` where it holds ``edited`` itself (an in-place edit reading the gradient it edits)."""
    if edited is not None and value is edited:
        raise RuntimeError(f"{edited.param_name}: an in-place edit reading the gradient itself is not supported on sharded gradients; "
                           "gather it with p.grad.full_tensor()")
    if isinstance(value, ShardedGrad):
        return value.full_tensor()
    if isinstance(value, (list, tuple)):
        return type(value)(_gathered(v, edited) for v in value)
    return value


def _vector_norm(name: str, ord: Any, grad: Tensor) -> bool:
    """Whether a norm call is the vector norm of all elements (``linalg_norm`` with an ``ord`` of a matrix is a matrix norm)."""
    return name != "linalg_norm" or ord in (None, "fro") or grad.dim() < 2


def _converts_to_itself(grad: Tensor, func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a conversion (``to``, ``cpu``, ``float``, ...) of ``grad`` keeps its device and dtype."""
    probe = _disabled(func, torch.empty(0, dtype=grad.dtype, device=grad.device), *args, **kwargs)
    return isinstance(probe, Tensor) and probe.dtype == grad.dtype and probe.device == grad.device


def make_sharded_grad(param: nn.Parameter, home: GradHome, index: int) -> ShardedGrad:
    """A new ``ShardedGrad`` for ``param`` (its shape, dtype and device; one element of storage)."""
    # NaN: a read that bypasses torch functions (torch.tensor(p.grad), a C++ extension) shows it is not the gradient
    grad = make_subclass(ShardedGrad, torch.full((), math.nan, dtype=param.dtype, device=param.device).expand(param.shape))
    grad.home, grad.param_index = home, index
    grad.placeholder = _disabled(grad.data_ptr)
    return grad


def bind_virtual_grads(shard: LocalShard, comm: GradComm, space: ParamSpace) -> None:
    """Give each virtual param of ``shard`` its between-step ``.grad``: a ``VirtualGrad`` over its piece, norms reduced over ``comm``.

    ``space`` numbers the optimizer's params (the shard's ``param_indices``); it grows to hold them."""
    space.size = max([space.size, *(i + 1 for i in shard.param_indices)])
    shard.idle_grads = [VirtualGrad.of(shard, p, v, comm, space) for p, v in zip(shard.pieces, shard.virtual_params)]
    shard.detach_grads()
