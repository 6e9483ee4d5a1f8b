"""Bucketed gradient reduce-scatter driven by post-accumulate-grad hooks.

See [Note: zeroshard buffers] in ``zeroshard/layout/flat_buffer.py`` and "One step" and "Collective order" in
``docs/design.md``: buckets launch in one order on every rank, and a callback at the end of each backward completes every
bucket (a missing gradient is zero) and waits for its reductions, as DDP's reducer finalizes.
"""

from __future__ import annotations

import contextlib
import datetime
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.autograd import Variable

from zeroshard.comm.groups import ShardingGroups
from zeroshard.compat import accumulates_into_grad, current_graph_task, last_post_accumulate_grad_hook_id
from zeroshard.grad.partial_norm import GradComm, ParamSpace
from zeroshard.grad.refusals import read_inside_no_sync, sparse_gradient, unfrozen_under_no_sync
from zeroshard.grad.shard_grads import ShardGrads
from zeroshard.grad.sharded_grad import ShardedGrad, bind_virtual_grads
from zeroshard.layout.local_shard import LocalShard
from zeroshard.reduce import bucket
from zeroshard.reduce.bucket import MAX_BUCKETS_IN_FLIGHT, BucketOrder, PendingReduce, StagingBuckets
from zeroshard.reduce.coordinator import EndOfBackward, coordinator_of, ddp_wrappers_of_owners, held
from zeroshard.reduce.ddp import DDPWrappers, find_wrappers, release, watch_new_wrappers
from zeroshard.reduce.records import HAS_LOCAL, REDUCED_ONCE, OutermostBackward, StepPhase, param_hooks, weak_method

_CLEAN, _LOCAL, _REDUCED = StepPhase.CLEAN, StepPhase.LOCAL, StepPhase.REDUCED  # per-param hooks: 1/6 of an Enum member's read time


class GradReducer:
    """Reduce-scatters gradients, bucket by bucket, into each shard's ``grad_shard``.

    Stage 1 overwrites the grad shard with each reduction of the flat grad buffer (the running local sum); stage 2 adds
    each reduction of its staging buckets into it, at most ``MAX_BUCKETS_IN_FLIGHT`` in flight ("One step", "Gradient
    accumulation": ``docs/design.md``). The grad shard ends up holding the ranks' mean (ZeRO, §5.2).

    Args:
        shards: the local shards whose params get hooks.
        stage: 1 or 2.
        groups: the shard group (reduce-scatter) and, hybrid, the replicate group (all-reduce of the reduced slice).
        reduce_dtype: dtype of the reduce-scatter; ``None``: each param's own dtype.
        overlap_comm: launch buckets in backward as they complete (``True``) or all at its end.
        timeout: the bound on each reduction's wait; ``None``: the group's.
    """

    def __init__(self, shards: list[LocalShard], *, stage: int, groups: ShardingGroups, reduce_dtype: torch.dtype | None, overlap_comm: bool,
                 timeout: datetime.timedelta | None = None) -> None:
        self.stage = stage
        self.timeout = timeout
        self.groups = groups
        self.reduce_dtype = reduce_dtype
        self.overlap_comm = overlap_comm
        self._comm = GradComm(groups.shard, timeout, weak_method(self.reduce_pending))
        self._space = ParamSpace()  # the params as torch.optim numbers them
        self._grads: list[ShardGrads] = []  # per shard: its gradient bookkeeping
        self._reduce_dtypes: list[torch.dtype] = []  # per shard (read per gradient: no property call)
        self._order = BucketOrder()
        self._staging = StagingBuckets()  # stage 2
        self._pending: list[PendingReduce] = []  # launched reductions
        # The last gradient, untaken while a hook registered after zeroshard's is to run (taken before the next accumulation or
        # at the pass's end, as DDP sees it): (shard, index, param, .grad as left, its version).
        self._deferred: tuple[int, int, nn.Parameter, Tensor, int] | None = None
        self._next_launch = 0
        self.end_of_backward = EndOfBackward.NONE  # see coordinator.py
        self._outermost = OutermostBackward(weak_method(self._queue_end_of_backward))  # reentrant checkpoints
        self._no_sync = False
        self.phase = _CLEAN  # where this step's gradients are
        self._early = False  # the last reduction: reduce_pending
        self._kept_noted = False  # since the last reset
        self._reset_marks: list[tuple[int, int]] | None = None  # ShardGrads.marks() at the last reset (None: used)
        self._backward_started = False  # a gradient of this backward pass arrived
        self.followed_task = -1  # the graph task (backward pass) that last reached these params
        self._ddp_reduced = False  # DDP reduced a backward of this step too: its writes to .grad are ignored
        self._ddp_forward = False  # a DDP wrapper's forward ran (its no_sync holds for its passes)
        self._ddp_no_sync = False  # ... under ddp.no_sync(): this backward accumulates locally
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self.grow: Callable[[], object] | None = None  # the optimizer's: shard params unfrozen since; whether it did (flush)
        # The DDP wrappers around these params: switched off, their reducers released (DDPWrappers.adopt).
        self.ddp_wrappers = DDPWrappers(weak_method(self._on_ddp_forward), weak_method(self._sync_next_backward))
        # The hooks hold it weakly and go with it (or close()); not at exit (DDP's process group may be gone).
        self._remove_hooks = weakref.finalize(self, release, self._hooks, self.ddp_wrappers)
        self._remove_hooks.atexit = False
        self.closed_because = ""
        self.coordinator = coordinator_of(groups.shard)  # the turns of this group's reducers, who owns which param
        for shard in shards:
            self.add_shard(shard)
        self.coordinator.register(self)
        watch_new_wrappers(ddp_wrappers_of_owners)
        self.ddp_wrappers.adopt(find_wrappers(p for shard in shards for p in shard.buffer.params))
        self.ddp_wrappers.release()  # a model wrapped before the optimizer was built: not in a backward now

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (no hooks, no claim on params)."""
        return not self._remove_hooks.alive

    @property
    def accumulating(self) -> bool:
        """Whether this backward accumulates locally: under ``no_sync`` (its own or a DDP wrapper's)."""
        return self._no_sync or self._ddp_no_sync

    @property
    def launched_all(self) -> bool:
        """Whether it launches nothing more in this backward pass."""
        return self._next_launch == len(self._order.order) or self.accumulating or self.end_of_backward is EndOfBackward.DONE

    def close(self, reason: str = "it was closed") -> None:
        """Remove every hook, give up the params; ``reason``: why, for later errors (idempotent)."""
        if not self.closed:
            self.closed_because = reason
        self._remove_hooks()
        self.coordinator.recount()

    def add_shard(self, shard: LocalShard) -> None:
        """Register ``shard``'s params: hooks, launch order, and (stage 1) a flat grad buffer."""
        k = len(self._grads)
        self._grads.append(ShardGrads(shard, flat=self.stage == 1, comm=self._comm))
        self._reduce_dtypes.append(self.reduce_dtype or shard.buffer.dtype)
        bind_virtual_grads(shard, self._comm, self._space)
        self._order.append(k, len(shard.buffer.layout.buckets))
        for i, param in enumerate(shard.buffer.params):
            pre_hook, post_hook = param_hooks(self, k, i, param)
            self._hooks.append(param.register_hook(pre_hook))
            self._hooks.append(param.register_post_accumulate_grad_hook(post_hook))
            self._grads[k].hook_ids[i] = self._hooks[-1].id
            self.coordinator.own(param, self)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, with no communication, in the block."""
        if self.grow is not None:
            self.grow()  # params unfrozen since: sharded into param_groups (a collective if any)
        previous = self._no_sync
        self._no_sync = True
        self.accumulate_locally(unshard=True)
        self._reset_marks = None
        try:
            yield
        finally:
            self._no_sync = previous
            self.end_pass()  # the block's passes are over (even one that raised)

    # -- what user code did to the gradients --

    def before_accumulate(self, k: int, i: int, param: nn.Parameter, grad: Tensor) -> None:
        """Param ``i`` of shard ``k``'s pre-hook: take the deferred gradient, follow what user code did to ``.grad``, swap a ShardedGrad out."""
        task = current_graph_task()
        if task != self.followed_task and not accumulates_into_grad(param, task):  # torch.autograd.grad()
            return
        self._reset_marks = None
        if self._deferred is not None or not self.coordinator.alone:
            self.coordinator.take_deferred(self)  # before this accumulation bumps the flat grad's version
        if not self._backward_started:
            syncs = self.ddp_wrappers.adopt_new()  # may raise: nothing changed yet
            self._backward_started = True
            self._note_kept()
            self._ddp_no_sync = self._ddp_forward = self._ddp_forward and self._ddp_no_sync  # ddp.no_sync(): all passes of its forward
            if any(syncs):
                self._ddp_reduced = True
                for grads in self._grads:  # before DDP's reducer reads or writes .grad
                    grads.swap_out_sharded_grads()
            elif syncs:  # ``ddp.no_sync()`` (HF Trainer's, accelerate's first micro-step): accumulate locally
                self._ddp_no_sync = True
                self.accumulate_locally()
            self._check_flat_grads()
            for grads in self._grads if self.phase in REDUCED_ONCE else ():
                grads.refuse_edits_before_rereduction(self._early)
        if task != self.followed_task:  # once per backward pass: did the model move?
            self.followed_task = task
            for grads in self._grads:
                grads.shard.follow_all()
        grads = self._grads[k]
        grads.before_accumulate(i, param, reduced=self.phase in REDUCED_ONCE, follow=not self._ddp_reduced)
        if grads.flat is not None and not self._ddp_reduced and not grad.is_sparse:
            grads.hand_flat_view(i, param)

    def _on_ddp_forward(self, no_sync: bool) -> None:
        """Before an adopted DDP wrapper's forward: under ``ddp.no_sync()`` its backward accumulates locally."""
        if self._ddp_no_sync:
            self.end_pass()  # the last forward's (local) passes are over
        self._ddp_forward = True
        self._ddp_no_sync = no_sync
        if no_sync:
            self.accumulate_locally(unshard=True)

    def accumulate_locally(self, unshard: bool = False) -> None:
        """Accumulate locally (``no_sync``; shards added mid-step): a reduction's gradients made whole with ``unshard``
        (:func:`bucket.unshard`), or kept and the next reduction reduces all again (nothing summed twice)."""
        self._note_kept()
        if self.phase is _REDUCED and unshard and not (self._ddp_reduced or self._early):  # early: DDP's .grad was local
            bucket.unshard(self._grads, self.groups, self.timeout)
            self.phase = _LOCAL
        else:
            self.phase = self.phase.after_local

    def _sync_next_backward(self) -> None:
        """A framework asked DDP's released reducer to reduce the coming backward (``prepare_for_backward``)."""
        self._ddp_no_sync = False

    def _check_flat_grads(self) -> None:
        """Stage 1: follow in-place writes to the params' ``.grad`` (may raise: :meth:`ShardGrads.follow_flat_writes`)."""
        if not self._ddp_reduced:
            for grads in self._grads:
                grads.follow_flat_writes(reduced=self.phase in REDUCED_ONCE)

    def _note_kept(self) -> None:
        """Once per reset, at the first backward, ``no_sync`` or step: which params have a ``.grad`` (``ShardGrads.kept``)."""
        if not self._kept_noted:
            self._kept_noted = True
            for grads in self._grads:
                grads.note_kept()

    def settle_all(self) -> None:
        """Before a step: follow what was done to every param's gradient."""
        self._note_kept()
        self._check_flat_grads()
        if not self._ddp_reduced:
            for grads in self._grads:
                grads.settle_all()

    # -- backward --

    def on_grad_ready(self, k: int, i: int, param: nn.Parameter) -> None:
        """Param ``i`` of shard ``k``'s post-accumulate-grad hook: take its gradient, or defer it while a later hook is to run (``_deferred``).

        Raises:
            RuntimeError: a sparse gradient; see :meth:`ShardGrads.refuse_partial_write`.
        """
        grad = param.grad
        if grad is None:
            return
        if grad.is_sparse:
            raise sparse_gradient(param)
        grads = self._grads[k]
        grads.used[i] = True
        if grads.flat is not None:
            grads.keep_in_flat_grad(i, param)
        if self._no_sync or self._ddp_no_sync:  # accumulating
            grads.note_local(i, param)
            if self.phase not in HAS_LOCAL:  # after a zero_grad() or a read of param_groups' .grad in the block
                self.phase = self.phase.after_local
            if self.coordinator.shared():  # the others reduce at the pass's end
                self._queue_end_of_backward()
            return
        if grads.continued[i]:
            grads.refuse_partial_write(i, grads.hooked_before(i, param))
        if self.end_of_backward is EndOfBackward.NONE:
            self._queue_end_of_backward()
        if self._ddp_reduced or last_post_accumulate_grad_hook_id(param) == grads.hook_ids[i]:
            # No hook runs after zeroshard's (DDP's reducer reads .grad as left): take it; alone, only its bucket can launch.
            if (self._take_grad(k, i, param) or not self.coordinator.alone) and self.overlap_comm:
                self.launch_complete_buckets()
        else:
            held = param.grad  # stage 1: its flat view now; the last deferred was taken in this pre-hook
            if held is None:  # (not typing.cast: a Python call per gradient)
                raise RuntimeError("internal error: a gradient checked above is gone before it is deferred")
            self._deferred = (k, i, param, held, held._version)

    def take_deferred(self) -> None:
        """Take the gradient deferred last, now that the hooks after zeroshard's have run (may raise: ``refuse_partial_write``)."""
        if self._deferred is None:
            return
        (k, i, param, held, version), self._deferred = self._deferred, None
        grads = self._grads[k]
        if grads.continued[i]:  # else nothing to refuse; changed: written in place or replaced by a hook
            grads.refuse_partial_write(i, param.grad is not held or held._version != version)
        if param.grad is None:  # a hook dropped it: as in DDP, the param is unused on this rank
            grads.used[i] = False
        if grads.flat is not None:
            grads.keep_in_flat_grad(i, param)  # a hook may have replaced .grad or its storage (None: zeroes it)
        if (self._take_grad(k, i, param) or not self.coordinator.alone) and self.overlap_comm:  # as in on_grad_ready
            self.launch_complete_buckets()

    def _take_grad(self, k: int, i: int, param: nn.Parameter, last: bool = False) -> bool:
        """Count a gradient of param ``i`` of shard ``k`` (``last``: at the pass's end), stage 2 staging it; whether its bucket completed."""
        grads = self._grads[k]
        key = (k, grads.bucket_of[i])
        if self._order.position[key] < self._next_launch:
            # More gradients than ever, its bucket reduced (OutermostBackward): reduce_late reduces it.
            grads.arrivals[i] += 1
            self._order.completed(key)  # it completes now in the next passes
            return False
        grad = param.grad
        if grad is not None and not isinstance(grad, ShardedGrad):
            if grads.flat is None:  # stage 2: held until the launch; a DDP reducing this pass may reduce it in place first
                self._staging.add(key, i, grad.clone() if self._ddp_reduced else grad, self._reduce_dtypes[k])
                param.grad = None if self._ddp_reduced else grads.sharded_grad(i, param)
            elif not self._ddp_reduced:  # stage 1: a later write (a node hook) would reach the flat grad's reduction unseen
                param.grad = grads.sharded_grad(i, param)
        if not grads.take(i, last):
            return False
        self._order.completed(key)
        return True

    def launch_complete_buckets(self, in_turn: bool = True) -> None:
        """Launch the complete buckets in order; ``in_turn``: after the group's earlier reducers."""
        if in_turn and not self.coordinator.turn_has_come(self):
            return
        while self._next_launch < len(self._order.order):
            k, b = self._order.order[self._next_launch]
            if self._grads[k].ready_count[b] < self._grads[k].bucket_sizes[b]:
                return
            self.coordinator.drain_earlier(self)
            self._launch(k, b)
            self._next_launch += 1
        self.coordinator.let_later_launch(self)

    def drain(self) -> None:
        for pending in self._pending:
            self._complete(pending)
        self._pending.clear()

    def _queue_end_of_backward(self) -> None:
        if self.end_of_backward is EndOfBackward.NONE:  # at the pass's end: completes and waits for every bucket
            Variable._execution_engine.queue_callback(self._on_backward_end)
            self.end_of_backward = EndOfBackward.QUEUED

    def _on_backward_end(self) -> None:
        """At the end of backward: the group's reducers, this one included, reduce this pass (ReduceCoordinator.flush)."""
        # Not yet the end of a reentrant checkpoint's nested backward; or another reducer's flush ran.
        if self._outermost.defer() or self.end_of_backward is EndOfBackward.DONE:
            self.end_of_backward = EndOfBackward.NONE
        else:
            self.coordinator.flush(self)

    def _launch(self, k: int, b: int) -> None:
        grads_of = self._grads[k]
        buffer = grads_of.shard.buffer
        dtype = self._reduce_dtypes[k]
        if self.stage == 1:
            grads, frozen = bucket.stage1_input(buffer.bucket_view(b, of=grads_of.flat), dtype, self.groups.shard_size)
        else:
            staged = self._staging.pop((k, b), buffer.layout)
            # None: no param of the bucket got a gradient on this rank
            grads = staged if staged is not None else torch.zeros(buffer.layout.buckets[b].padded_numel, dtype=dtype, device=buffer.device)
            frozen = True  # a staging bucket: written again only once recycled, after the reduction
        fresh = self.stage == 1 or not grads_of.landed[b]
        grads_of.landed[b] = True
        self._pending.append(bucket.launch(grads, grads_of.shard.grad_slice(b), self.groups, k, b, fresh=fresh, input_frozen=frozen))
        if self.stage == 2 and len(self._pending) > MAX_BUCKETS_IN_FLIGHT:
            # bound stage 2's gradient memory
            self._complete(self._pending.pop(0))

    def _complete(self, pending: PendingReduce) -> None:
        """Wait for one reduction, leave it in the grad shard, recycle its staging buffer."""
        bucket.complete(pending, self.groups, self.timeout, overwrite=self.stage == 1)
        if self.stage == 2:
            self._staging.recycle(pending.input)

    def reduce_everything(self) -> None:
        """Complete every bucket not yet launched, launch it, add all results into the grad shards (:meth:`rebuild_order` follows)."""
        self._reset_marks = None
        self.take_deferred()
        for k, grads in enumerate(self._grads):
            for i, param in enumerate(grads.shard.buffer.params):
                if not grads.ready[i]:
                    grads.follow_untaken(i, param, self._ddp_reduced)
                    self._take_grad(k, i, param, last=True)
        self.launch_complete_buckets(in_turn=False)
        self.drain()
        if not self._ddp_reduced:  # else a DDP reduced this backward itself: its .grad stay (ignored)
            for grads in self._grads:
                grads.leave_sharded_grads()
        self.end_pass()
        self.phase = _REDUCED
        self._early = False
        for grads in self._grads:
            grads.note_written()

    def rebuild_order(self) -> None:
        """Adopt rank 0's launch order of the first reduced backward (a collective, once: :class:`BucketOrder`)."""
        self._order.rebuild(self.groups, self.timeout)

    def drop_unused_grads(self, used: list[list[bool]]) -> None:
        """At ``step()``: params no rank gave a gradient (``used``) keep ``.grad = None``."""
        for grads, flags in zip(self._grads, used):
            grads.drop_unused(flags)

    def end_pass(self) -> None:
        """Forget this backward pass (also one under ``no_sync``: the next pass's start checks run)."""
        self._next_launch = 0
        if self.end_of_backward is EndOfBackward.QUEUED:  # DONE stays: its callback is to return at once
            self.end_of_backward = EndOfBackward.NONE
        self._outermost.clear()
        self._deferred = None
        self._backward_started = False
        for grads in self._grads:
            grads.clear_backward()

    def reduce_for_step(self) -> None:
        """Reduce what is still local: ``no_sync`` gradients, or those of no reduced backward."""
        if self.phase in HAS_LOCAL and not self._ddp_reduced:  # raises if user code edited them (before settle_all)
            for grads in self._grads:
                grads.refuse_local_edits()
        self.settle_all()
        if self.phase is not _REDUCED:
            self.reduce_everything()
            self.rebuild_order()
            if self.coordinator.alone:  # else the group's flush checks, once every optimizer has grown
                self.ddp_wrappers.check_covered(held)

    def reduce_late(self) -> None:
        """End of backward: a param got more gradients than ever (reentrant checkpoints; one maybe after its bucket's
        reduction): every bucket again, as all ranks count alike (design.md, "Activation checkpointing")."""
        if any(grads.grew for grads in self._grads):
            self.settle_all()
            self.reduce_everything()

    def reduce_pending(self) -> None:
        """Before a virtual param's ``.grad`` is used (a clip over ``param_groups``): reduce what is local (as ``step()``).

        Raises:
            RuntimeError: inside ``no_sync()``; params unfrozen inside it, which ``param_groups`` lacked."""
        if self.phase in HAS_LOCAL:
            if self._no_sync:
                raise read_inside_no_sync()
            if self.grow is not None and self.grow():
                raise unfrozen_under_no_sync()
            self.reduce_for_step()
            self._early = True

    def local_used(self) -> list[list[bool]]:
        """Per shard, per param: whether it got a gradient on this rank since the last reset."""
        return [list(grads.used) for grads in self._grads]

    @torch.no_grad()
    def reset(self) -> None:
        """Zero the grad shards (and flat grad buffers), forget which params were used and what a backward that raised or a DDP
        wrapper left; at once when nothing happened since the last reset."""
        if self._reset_marks is not None and self._reset_marks == self._marks():
            return
        if self._ddp_reduced:
            self._ddp_reduced = False
            for grads in self._grads:
                for param in grads.shard.buffer.params:
                    param.grad = None
        self.ddp_wrappers.release()  # between backward passes: a backward a DDP wrapper reduced is over
        for pending in self._pending:  # left by a backward that raised (some write into the grad shard: first)
            bucket.wait(pending.work, self.timeout, pending.what)
        self._pending.clear()
        for grads in self._grads:
            grads.reset()
        self.end_pass()
        self._staging.clear()  # stage 2 holds no gradient buffers between steps
        self.phase = _CLEAN
        self._early = self._kept_noted = False
        self.end_of_backward = EndOfBackward.NONE
        self._reset_marks = self._marks()

    def _marks(self) -> list[tuple[int, int]]:
        return [m for g in self._grads for m in g.marks()]

    def grad_buffers(self) -> list[Tensor]:
        """The gradient buffers it owns: stage 1 flat grads, stage 2 staging buckets (pooled too)."""
        in_flight = [p.input for p in self._pending] if self.stage == 2 else []
        return [g.flat for g in self._grads if g.flat is not None] + self._staging.buffers() + in_flight
