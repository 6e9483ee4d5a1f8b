"""``ShardGrads``: what the gradient reducer tracks for one local shard (the flat grad buffer: [Note: zeroshard buffers] in ``layout/flat_buffer.py``)."""

from __future__ import annotations

import operator
import weakref

import torch
from torch import Tensor, nn

from zeroshard.compat import DisableTorchFunction, DisableTorchFunctionSubclass, post_accumulate_grad_hook_ids
from zeroshard.grad.partial_norm import GradComm
from zeroshard.grad.refusals import edited_after_reduction, edited_before_reduction
from zeroshard.grad.sharded_grad import ShardedGrad, make_sharded_grad
from zeroshard.layout.local_shard import LocalShard


class ShardGrads:
    """The gradient bookkeeping of one :class:`~zeroshard.layout.local_shard.LocalShard` (``GradReducer``'s, per shard); per param: in layout order.

    Args:
        shard: its params, grad shard and names.
        flat: allocate the stage-1 flat grad buffer (zeros).
        comm: the shard group the grad shard's pieces are spread over (for the ShardedGrads' reads).
    """

    def __init__(self, shard: LocalShard, flat: bool, comm: GradComm) -> None:
        layout = shard.buffer.layout
        n, buckets = len(layout.slots), len(layout.buckets)
        self.shard = shard
        self.comm = comm
        # stage 1: 1-D, param dtype, the flat param buffer's layout: the params' .grad are views of it; None under stage 2
        self.flat: Tensor | None = torch.zeros_like(shard.buffer.data) if flat else None
        self.flat_version = 0  # flat._version when zeroshard last wrote it (a later version: user code wrote the gradients)
        self.shard_version = 0  # the grad shard's _version when zeroshard last wrote it (a later one: a VirtualGrad was edited)
        self.edited = False  # a ShardedGrad of this shard was edited in place (not zeroed) since the last reset
        self.note_written()
        # per param, this rank's pieces of it: (offset in the flattened param, 1-D view of the grad shard) each
        self.pieces_of: list[list[tuple[int, Tensor]]] = [[] for _ in range(n)]
        for p in shard.pieces:
            self.pieces_of[p.param].append((p.param_offset, shard.grad_shard[p.shard_offset : p.shard_offset + p.numel]))
        self.whole = [layout.within_one_slice(i) for i in range(n)]  # per param: it lies whole in one rank's slice, whose norm of it is torch's of DDP's
        self.bucket_of = [slot.bucket for slot in layout.slots]  # per param, its bucket (the layout's, read per gradient)
        self.bucket_sizes = [len(b.params) for b in layout.buckets]  # per bucket, how many params it has
        self.ready = [False] * n  # per param: its gradients of the current backward pass were taken (all that are expected)
        self.ready_count = [0] * buckets  # per bucket: how many of its params are ready
        self.used = [False] * n  # per param: it got a gradient on this rank since the last reset
        self.continued = [False] * n  # per param: an earlier backward of this step reduced the gradient it holds (refuse_partial_write)
        self.kept = [False] * n  # per param: it had a .grad as the step began (DDP's: zeroing keeps it)
        self.arrivals = [0] * n  # per param: gradients taken in this backward pass (reentrant checkpoints: several)
        self.expected = [1] * n  # per param: the most gradients taken in one pass so far: ready once that many arrived
        self.grew = False  # some param got more gradients in the last pass than in any before (clear_backward)
        self.zeroed = [flat] * n  # stage 1, per param: its view of flat holds zeros since the last reset and was not taken since
        self.landed = [False] * buckets  # per bucket: reduced into its grad shard slice since the reset (stage 2 adds next)
        self.live = False  # a reduction left gradients in the grad shard that no step() has consumed yet (reset)
        self.reductions = 0  # how many times a reduction left gradients here (ShardedGrad.zeroed)
        self.reduced: dict[int, ShardedGrad] = {}  # per param, the ShardedGrad left in its .grad once reduced (made once)
        self.reduced_versions: dict[int, int] = {}  # per param, that ShardedGrad's version when left (absent: none left since)
        self.flat_views: list[Tensor] = []  # stage 1, per param: its view of ``flat`` (flat_view)
        self.flat_addresses: list[int] = []  # their data pointers: where each view must point
        self.hook_ids: dict[int, int] = {}  # per param, the handle id of zeroshard's post-accumulate-grad hook on it
        self.local: dict[int, tuple[weakref.ref[Tensor], int]] = {}  # stage 2, per param: .grad (weakly), version after no_sync()

    def note_written(self) -> None:
        """Record that zeroshard wrote :attr:`flat` and the grad shard last: no edit of either since (:attr:`edited`)."""
        self.flat_version = self.flat._version if self.flat is not None else 0
        self.shard_version = self.shard.grad_shard._version
        self.edited = False

    def clear_backward(self) -> None:
        """Forget which params were taken in the current backward pass (learning how many gradients each got)."""
        self.ready = [False] * len(self.ready)
        self.ready_count = [0] * len(self.ready_count)
        expected = [max(e, a) for e, a in zip(self.expected, self.arrivals)]
        self.grew, self.expected = expected != self.expected, expected
        self.arrivals = [0] * len(self.arrivals)

    def take(self, i: int, last: bool) -> bool:
        """Count a gradient of param ``i`` taken (``last``: the end of the pass, none arrived); whether its bucket just became complete."""
        self.arrivals[i] += not last
        if self.ready[i] or not (last or self.arrivals[i] >= self.expected[i]):
            return False
        self.ready[i] = True
        bucket = self.bucket_of[i]
        self.ready_count[bucket] += 1
        return self.ready_count[bucket] == self.bucket_sizes[bucket]

    def reset(self) -> None:
        """Between steps: zero the grad shard and flat grad buffer and forget which params were used (:meth:`_forget_reduced`)."""
        if self.flat is not None:
            self.flat.zero_()
            self.zeroed = [True] * len(self.zeroed)
        self.used = [False] * len(self.used)
        self._forget_reduced()

    def _forget_reduced(self) -> None:
        """Zero the grad shard, forget which slices were reduced into and what no_sync() left; note zeroshard's writes."""
        self.shard.grad_shard.zero_()
        self.continued = [False] * len(self.continued)
        self.landed = [False] * len(self.landed)
        self.live = False
        self.local.clear()
        self.note_written()

    @torch.no_grad()
    def unshard(self, full: Tensor, used: list[bool]) -> None:
        """After a reduction, before a ``no_sync()`` backward: each param's ``.grad`` that is still the ``ShardedGrad`` left (edited
        in place or not) becomes DDP's averaged gradient, a local tensor autograd accumulates into, taken from ``full`` (1-D, the
        grad shard's dtype, the flat layout: every rank's slices, :func:`~zeroshard.reduce.bucket.unshard`), or ``None``
        where no rank gave the param a gradient (``used``, per param). What user code set ``.grad`` to stays (``None``: dropped,
        a tensor of its own). The grad shard is zeroed: the step's gradients are all local again, as under DDP."""
        params = self.shard.buffer.params
        if self.flat is not None:
            self.flat.copy_(full)
        grads = full if self.flat is None else self.flat
        for i, param in enumerate(params):
            if self.reduced_versions.pop(i, None) is not None and param.grad is self.reduced[i]:
                self.used[i] = used[i]
                # stage 2: a tensor of its own, as autograd's (views of one would share its version counter: note_local)
                view = self.shard.buffer.param_view(i, of=grads).view_as(param)
                param.grad = (view if self.flat is not None else view.to(param.dtype, copy=True)) if used[i] else None
            else:
                self.used[i] = param.grad is not None
            if self.flat is not None:
                self.keep_in_flat_grad(i, param)  # None: zeroed; a tensor of the user's: copied in, the view its .grad
                self.zeroed[i] = param.grad is None
        self._forget_reduced()

    def sharded_grad(self, i: int, param: nn.Parameter) -> ShardedGrad:
        """The ShardedGrad to leave in param ``i``'s ``.grad`` once reduced (made once), its version noted as left."""
        with DisableTorchFunctionSubclass():  # its attributes without a Python call each (once per param and backward)
            left = self.reduced.get(i)
            if left is None or left.device != param.device or left.dtype != param.dtype:
                left = self.reduced[i] = make_sharded_grad(param, self, i)
            self.reduced_versions[i] = left._version
        return left

    def flat_view(self, i: int) -> Tensor:
        """Stage 1: param ``i``'s view of the flat grad buffer, shaped like the param (its running local gradient); made again
        if its storage was replaced (``.grad.data = t``, ``Module._apply``): callers copy the old into it (:meth:`keep_in_flat_grad`)."""
        if self.flat is None:
            raise RuntimeError("internal error: stage 2 keeps no flat grad buffer")
        if not self.flat_views:
            self.flat_views = [self._make_flat_view(j) for j in range(len(self.shard.buffer.params))]
            self.flat_addresses = [view.data_ptr() for view in self.flat_views]
        view = self.flat_views[i]
        if view.data_ptr() != self.flat_addresses[i]:
            view = self.flat_views[i] = self._make_flat_view(i)
        self.zeroed[i] = False  # whoever takes the view may write it
        return view

    def _make_flat_view(self, i: int) -> Tensor:
        return self.shard.buffer.param_view(i, of=self.flat).view_as(self.shard.buffer.params[i])

    def marks(self) -> list[tuple[int, int]]:
        """The grad shard's and :attr:`flat`'s identity and version: equal marks mean neither was written in between."""
        return [(id(t), t._version) for t in (self.shard.grad_shard, self.flat) if t is not None]

    def follow_untaken(self, i: int, param: nn.Parameter, ddp_reduced: bool) -> None:
        """At a pass's end, before param ``i``'s gradient (not taken in the pass) is reduced: follow what user code did to ``.grad``
        (:meth:`settle`, :meth:`follow_local`: ``None`` means unused), note one of this rank's own as used, keep it in :attr:`flat`."""
        if not ddp_reduced:
            self.settle(i, param)
            self.follow_local(i, param)
        grad = param.grad
        if grad is None and self.flat is None and not ddp_reduced:
            self.used[i] = False
        elif grad is not None and not isinstance(grad, ShardedGrad) and not (self.flat is not None and grad.data_ptr() == self.flat_view(i).data_ptr()):
            self.used[i] = True
        if self.flat is not None and not isinstance(grad, ShardedGrad):  # a ShardedGrad's local sum is in the flat grad already
            self.keep_in_flat_grad(i, param)

    def keep_in_flat_grad(self, i: int, param: nn.Parameter) -> None:
        """Stage 1: make param ``i``'s ``.grad`` its view of :attr:`flat`, copying if autograd made a new one (``None``: zeroes it)."""
        view = self.flat_view(i)
        grad = param.grad
        if grad is None:
            view.zero_()
        elif grad is not view and grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
            param.grad = view

    def hand_flat_view(self, i: int, param: nn.Parameter) -> None:
        """Stage 1, before autograd accumulates into param ``i`` with no ``.grad``: hand it its zeroed view of :attr:`flat` (no copy,
        the same ``.grad`` every step: DDP's ``gradient_as_bucket_view``)."""
        if self.zeroed[i] and param.grad is None:
            param.grad = self.flat_view(i)

    def leave_sharded_grads(self) -> None:
        """After a reduction: every param's ``.grad`` is its ``ShardedGrad`` (DDP's averaged gradient), also of a param with no
        gradient on this rank (another rank's may be in the grad shard, and every rank must present the same gradients to a clip).
        """
        self.live = True
        self.reductions += 1
        self.local.clear()
        for i, param in enumerate(self.shard.buffer.params):
            grad = param.grad
            if grad is None or (self.flat is not None and not isinstance(grad, ShardedGrad)):
                param.grad = self.sharded_grad(i, param)

    def drop_unused(self, used: list[bool]) -> None:
        """At ``step()``: params no rank gave a gradient (``used``, per param) keep ``.grad = None``, as under DDP (not the
        ``ShardedGrad`` of zeros :meth:`leave_sharded_grads` gave them, which ``zero_grad(set_to_none=False)`` would make a step apply).
        """
        if all(used):
            return
        for i, param in enumerate(self.shard.buffer.params):
            if not used[i] and isinstance(param.grad, ShardedGrad):
                param.grad = None
                self.reduced_versions.pop(i, None)

    def drop_pieces(self, i: int) -> None:
        """Zero this rank's pieces of param ``i`` in the grad shard (if any)."""
        if self.used[i]:
            for _, piece in self.pieces_of[i]:
                piece.zero_()

    def settle(self, i: int, param: nn.Parameter, take: bool = False) -> None:
        """Follow what user code did to param ``i``'s ``.grad`` since its gradient was reduced (docs/design.md, "What user code does").

        Set to ``None``: dropped (unused); zeroed in place: a zero gradient, stepped if DDP's ``.grad`` exists. Replaced by a full
        tensor: with ``take`` (at ``step()``) its elements become this rank's pieces and ``.grad`` the ``ShardedGrad`` again;
        else (a reduction of the new tensor follows) the old pieces are dropped."""
        version = self.reduced_versions.get(i)
        if version is None:
            return
        grad, left = param.grad, self.reduced[i]
        with DisableTorchFunctionSubclass():  # a ShardedGrad's version and data pointer without a Python call
            if grad is left and grad._version == version:
                return
            if grad is left and left.data_ptr() != left.placeholder:
                raise RuntimeError(f"{self.shard.buffer.names[i]}: Tensor.set_() replaced the storage of its sharded gradient, which "
                                   "zeroshard cannot follow; assign a new gradient instead (p.grad = t)")
        if take and grad is not None and grad is not left and not isinstance(grad, ShardedGrad):
            values = grad.detach().reshape(-1).to(self.shard.grad_shard.dtype)
            for offset, piece in self.pieces_of[i]:
                piece.copy_(values[offset : offset + piece.numel()])
            if self.flat is not None:
                self.flat_view(i).copy_(grad)
            self.used[i] = True
            param.grad = left
            self.reduced_versions[i] = left._version
            return
        if self.flat is not None and self.used[i]:  # else zero since the reset
            self.flat_view(i).zero_()
        self.drop_pieces(i)
        self.used[i] = grad is left and (self.used[i] or self.kept[i])
        self.kept[i] = self.kept[i] and grad is not None  # None: DDP's .grad is gone
        if grad is left:
            self.reduced_versions[i] = grad._version
        else:
            del self.reduced_versions[i]

    def before_accumulate(self, i: int, param: nn.Parameter, reduced: bool, follow: bool) -> None:
        """Before autograd accumulates a new gradient into param ``i``: set ``continued[i]`` (it holds one ``reduced`` in this step),
        with ``follow`` follow what user code did to it (:meth:`settle`), and swap its ``ShardedGrad`` out (:meth:`_swap_out`)."""
        if not reduced and (i not in self.reduced_versions or (param.grad is None and not self.used[i])):
            # The common cases: nothing reduced in this step, and no ShardedGrad left, or one a zero_grad() dropped after the
            # step's reset (nothing of it left to drop: what settle() would conclude).
            self.continued[i] = False
            self.reduced_versions.pop(i, None)
            return
        if reduced and follow:
            self.follow_local(i, param)
        held, left = param.grad, self.reduced.get(i)
        with DisableTorchFunctionSubclass():  # a ShardedGrad's version without a Python call
            self.continued[i] = reduced and held is not None and (
                self.flat is not None or (left is not None and held is left and self.reduced_versions.get(i) == left._version))
        if i in self.reduced_versions:
            if follow:
                self.settle(i, param)
            if param.grad is held and isinstance(held, ShardedGrad):
                self._swap_out(i, param)

    def swap_out_sharded_grads(self) -> None:
        """A DDP wrapper reduces this backward too: its C++ reducer reads and writes ``.grad`` past torch functions, also of params
        unused on this rank, which a ShardedGrad's one-element placeholder cannot take (``copy_`` into it raises on that rank
        alone). Follow each (:meth:`settle`) and swap it out, as :meth:`before_accumulate` does."""
        for i, param in enumerate(self.shard.buffer.params):
            if i in self.reduced_versions:
                self.settle(i, param)
            if isinstance(param.grad, ShardedGrad):
                self._swap_out(i, param)

    def _swap_out(self, i: int, param: nn.Parameter) -> None:
        """Replace param ``i``'s ShardedGrad in ``.grad`` with what autograd accumulates into: stage 1 its flat view, stage 2 ``None``."""
        param.grad = self.flat_view(i) if self.flat is not None else None
        self.reduced_versions.pop(i, None)

    def note_kept(self) -> None:
        """As the step's first backward, ``no_sync()`` or ``step()`` begins: note which params have a ``.grad`` (:attr:`kept`); a
        ``.grad`` user code gave a virtual param before then is forgotten (after: ``LocalShard.take_replaced_grads``)."""
        with DisableTorchFunction():  # no Python call per param while a gather's guard is on
            self.kept = [param.grad is not None for param in self.shard.buffer.params]
        self.shard.detach_grads()

    def refuse_edits_before_rereduction(self, early: bool) -> None:
        """At a backward after one that reduced this step: raise ``RuntimeError`` if a ``ShardedGrad`` or ``VirtualGrad`` was edited
        in place since, at stage 1 or after an ``early`` reduction (:func:`edited_after_reduction` says why)."""
        if (self.flat is not None or early) and (self.edited or self.shard.grad_shard._version != self.shard_version):
            raise edited_after_reduction()

    def note_local(self, i: int, param: nn.Parameter) -> None:
        """Param ``i``'s gradient was accumulated locally (``no_sync()``): note it as autograd left it (:meth:`refuse_local_edits`)."""
        if self.flat is not None:
            self.note_written()
        elif (grad := param.grad) is not None:
            self.local[i] = (weakref.ref(grad), grad._version)

    def follow_local(self, i: int, param: nn.Parameter) -> None:
        """Stage 2, before param ``i``'s gradient from ``no_sync()`` is added to or reduced: set to ``None`` or zeroed, DDP's went
        with an earlier reduction's part: its pieces are dropped. Raises ``RuntimeError`` if edited or replaced after one."""
        if (noted := self.local.pop(i, None)) is None:
            return
        grad = param.grad
        if grad is not None and grad is noted[0]() and grad._version == noted[1]:
            return
        if grad is not None and self.live and grad.any():  # a new tensor may hold values read from this rank's own alone
            raise edited_after_reduction()
        self.drop_pieces(i)

    def refuse_local_edits(self) -> None:
        """Before gradients accumulated under ``no_sync()`` are reduced for a step: raise ``RuntimeError`` if user code wrote them
        in place since their last backward (a clip of this rank's own gradient: each rank would scale its own, DDP the average)."""
        if self.flat is not None:
            edited = self.flat._version != self.flat_version and bool(self.flat.any())  # all zero: zero_grad(set_to_none=False)
        else:
            params = self.shard.buffer.params
            grads = [grad for i, (held, version) in self.local.items() if (grad := held()) is not None and grad is params[i].grad and grad._version != version]
            edited = any(bool(grad.any()) for grad in grads)  # all zero: followed (follow_local), as at stage 1
        if edited:
            raise edited_before_reduction()

    def refuse_partial_write(self, i: int, changed: bool) -> None:
        """Raise ``RuntimeError`` if a hook ``changed`` param ``i``'s gradient in a backward after one that reduced it in this step:
        the hook saw this rank's gradient (stage 2: this backward's only), where DDP shows the all-reduced sum."""
        if self.continued[i] and changed:
            raise RuntimeError(
                f"{self.shard.buffer.names[i]}: a post-accumulate-grad hook changed its gradient (or, registered before the optimizer, "
                "may have) in a backward after one that reduced it in this step, so the hook saw this rank's gradient, not the "
                "all-reduced sum DDP shows it. Accumulate micro-steps with opt.no_sync() (reduced once, at the last)")

    def hooked_before(self, i: int, param: nn.Parameter) -> bool:
        """Whether param ``i`` has post-accumulate-grad hooks registered before zeroshard's (they ran before it)."""
        return any(key < self.hook_ids.get(i, -1) for key in post_accumulate_grad_hook_ids(param))

    @torch.no_grad()
    def follow_flat_writes(self, reduced: bool) -> None:
        """Stage 1: follow in-place writes to the params' ``.grad`` since zeroshard last wrote :attr:`flat` (zeroed: what was reduced is dropped).

        Raises:
            RuntimeError: gradients written in place, not to zero, after they were ``reduced`` (a clip of this rank's own gradient).
        """
        if self.flat is None or self.flat._version == self.flat_version:
            return
        if self.flat.any():
            if reduced:
                raise RuntimeError(
                    "the params' .grad were modified in place after zeroshard reduced them (torch.nn.utils.clip_grad_norm_ or a "
                    "framework's clipping?): under ZeRO stage 1 .grad holds this rank's own, unreduced gradient, so the change "
                    "cannot be honoured. Clip with ShardedOptimizer(..., max_grad_norm=...) or opt.clip_grad_norm_(...)")
        else:
            self.shard.grad_shard.zero_()
            self.used[:] = [param.grad is not None for param in self.shard.buffer.params]
        self.note_written()

    def settle_all(self) -> None:
        """Before a step: follow what was done to every param's gradient (:meth:`settle`; stage 1: a flat view set to ``None``)."""
        params = self.shard.buffer.params
        if len(self.reduced_versions) == len(params):  # the common case: every .grad still the ShardedGrad left, unedited
            with DisableTorchFunctionSubclass():  # checked over lists, without a Python call per param (#27)
                grads = [param.grad for param in params]
                if all(map(operator.is_, grads, map(self.reduced.get, range(len(params))))) \
                        and [grad._version for grad in grads if grad is not None] == list(map(self.reduced_versions.__getitem__, range(len(params)))):
                    return
        for i, param in enumerate(params):
            if i in self.reduced_versions:
                self.settle(i, param, take=True)
            elif self.flat is not None and param.grad is None and self.used[i] and not self.ready[i]:
                self.drop_pieces(i)  # set to None after its gradient was reduced
                self.used[i] = False
