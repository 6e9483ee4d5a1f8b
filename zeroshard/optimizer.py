"""``ShardedOptimizer``: ZeRO stage 1/2 around any ``torch.optim.Optimizer``. Orchestration only.

See [Note: zeroshard buffers] in ``zeroshard/layout/flat_buffer.py`` for the buffers named here.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from zeroshard.compat import DelegatingOptimizer
from zeroshard.gather.param_gather import ParamGather, pop_guard_if_done
from zeroshard.memory import MemoryUsage, owned_memory
from zeroshard.offload.placement import Placement
from zeroshard.reduce.coordinator import coordinator_of
from zeroshard.reduce.grad_reducer import GradReducer
from zeroshard.reduce.records import weak_method
from zeroshard.shard_set import ShardSet
from zeroshard.state_dict import StateDictMixin
from zeroshard.step.fused_adam import FusedAdam, fused_adam_kind
from zeroshard.step.grad_norm import NORM_TYPES, GradStats, ReducedStats
from zeroshard.step.loss_scaler import DynamicLossScaler, choose_loss_scale
from zeroshard.step.pending_skip import PendingSkip, unscale
from zeroshard.step.wrapped import refuse_direct_steps
from zeroshard.update import SCALED_LOSSES, eager_step
from zeroshard.validation import check_construction

logger = logging.getLogger("zeroshard")

_BUILT = itertools.count()


class ShardedOptimizer(StateDictMixin, DelegatingOptimizer):
    """ZeRO stage 1/2 data parallelism around an already-built ``torch.optim`` optimizer.

    Each param group's trainable params are copied into one flat buffer per dtype and become
    views of it. The buffer is cut into buckets; each rank owns ``1/N`` of every bucket and hands
    the wrapped optimizer *virtual parameters* covering only that part, so optimizer state (and,
    for bf16/fp16 params, the fp32 master weights) exist for ``1/N`` of the model on each rank.
    Gradients are reduce-scattered bucket by bucket during backward (stage 2 frees the full
    gradients as it goes; stage 1 keeps them) and averaged over the group; after the update the
    slices are all-gathered back into the params. No DDP wrapper is needed: the optimizer does
    the data-parallel gradient reduction itself, and broadcasts rank 0's params at construction.

    Follows Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
    Models", SC'20, §5 (stages 1 and 2), with the virtual-parameter scheme of the SageMaker model
    parallel library; mirrors ``torch.distributed.optim.ZeroRedundancyOptimizer`` in API.

    Memory per rank (stage 2, Adam, bf16 params): ``2Ψ + 16Ψ/N`` bytes, N the shard group's size;
    :func:`zeroshard.estimate_memory` gives every case.

    Args:
        optimizer: a ``torch.optim.Optimizer`` instance built on the model's params, not yet
            stepped. Its ``param_groups`` stay the live list the user and LR schedulers see, with
            each group's ``"params"`` replaced by this rank's virtual parameters (fp32 for 16-bit
            params with ``master_weights``, else the param dtype; 1-D slices, or whole params shaped as before with
            ``partition="param"``). LBFGS and SparseAdam are refused. State created at
            construction (Adagrad's ``sum``) is sharded with the params.
        stage: 1 shards optimizer state and master weights; 2 also shards gradients.
        process_group: the data-parallel ranks and how they shard: ``None`` (the world, flat
            sharding), a ``ProcessGroup`` (e.g. a subgroup; ranks outside it run their own), a
            1-D ``DeviceMesh``, or a 2-D ``DeviceMesh`` with dims ("replicate", "shard") for
            hybrid (MiCS) sharding: state sharded within each "shard" group and replicated across
            "replicate" (see :func:`zeroshard.hybrid_mesh`). Gradients are averaged over all
            data-parallel ranks. Every member must build the optimizer on the same params, in the
            same order.
        bucket_size_mb: size of a gradient reduce-scatter / param all-gather bucket in MiB of the
            param dtype (DDP's default, 25). A param larger than this gets a bucket of its own.
        overlap_comm: reduce-scatter each bucket as soon as its gradients are ready during
            backward (``True``) or all buckets at the end of backward (``False``).
        reduce_dtype: dtype of the gradient reduce-scatter; ``None`` reduces in each param's dtype.
        max_grad_norm: clip every step's gradients to this global 2-norm (``None``: no clipping;
            :meth:`clip_grad_norm_` clips one step).
        offload: ``"cpu"`` keeps the fp32 master weights, ``exp_avg`` and ``exp_avg_sq`` in host
            memory; each step runs torch's fused CPU AdamW chunk by chunk, the grad copies in and the
            param copies out (pinned) overlapping it (ZeRO-Offload, Ren et al., USENIX ATC 2021).
            Adam/AdamW only. ``None``: everything on the params' device.
        gpu_margin_mem_ratio: with ``offload="cpu"``, the fraction (0.0 to 1.0) of the device
            memory the first iteration leaves unused (a :class:`~zeroshard.MemoryTracer` measures it
            up to the first ``step()``, resetting CUDA's peak statistics) that offloaded chunks may
            take back: they move to the device at the first step (PatrickStar; ColossalAI's
            ``ShardedOptimizerV2``). 0.0 is full offload; :attr:`placement` reports it.
        loss_scale: ``"dynamic"`` (a :class:`~zeroshard.DynamicLossScaler`), a fixed positive
            number, a ``DynamicLossScaler`` instance, or ``None``: dynamic when any trainable
            param is fp16, else none. With a loss scale active, call :meth:`backward` (or
            ``scale_loss(loss).backward()``) instead of ``loss.backward()``.
        partition: ``"flat"``: each rank owns ``1/N`` of every bucket as 1-D slices, for
            element-wise updates only; ``"param"``: each param is owned whole by one rank, chosen
            from the shapes to balance the update's work and state bytes (Muon's Newton-Schulz,
            Adafactor's factored moments: see ``docs/design.md``). ``None``: ``"flat"`` for
            ``torch.optim``'s element-wise classes (SGD, Adam, AdamW, Adamax, NAdam, RAdam,
            Adagrad, Adadelta, RMSprop, ASGD, Rprop), ``"param"`` for every other optimizer.
        assume_elementwise: ``True`` picks ``partition="flat"`` for an optimizer class outside
            those (a subclass, Lion, ...), on the caller's word that its update of each element
            depends on that element's param, gradient and state alone. If not, results are wrong.
        collective_timeout_s: seconds this rank waits for one of zeroshard's collectives (not the
            constructor's, which ranks may reach far apart) before raising a ``RuntimeError`` that names it: a rank
            that skipped a call becomes a clear error on those waiting; the process group is then unusable. ``None``: the
            process group's own timeout (30 minutes by default; gloo then aborts with no Python
            traceback). On NCCL the wait blocks the host. Each rank may set its own.
        overlap_param_gather: :meth:`step` returns with the param all-gathers in flight (forward
            order) to overlap the next forward, as Megatron-LM's ``overlap_param_gather``; any
            torch function given a param waits for its bucket first (see :meth:`wait_params`).
            ``False``: :meth:`step` waits for them.
        master_weights: ``True``: 16-bit params get fp32 master weights, grad shard and state.
            ``False`` (ColossalAI's option): the wrapped optimizer's own ``step()`` updates the
            params' slices in their dtype, as unsharded (torchao's ``bf16_stochastic_round``).
            Not with ``offload``.

    Raises:
        TypeError: an argument of the wrong type (named, with its value), ``process_group`` of
            another kind, or an ``optimizer`` that is not a ``torch.optim.Optimizer`` or is
            already wrapped (a ``ShardedOptimizer``, or one whose params are virtual params).
        ValueError: before any collective: an argument out of range (named, with its value); an
            LBFGS or SparseAdam; ``partition="flat"`` (or ``assume_elementwise=True``) for
            Adafactor or Muon; ``offload`` with another optimizer than Adam/AdamW, or ``gpu_margin_mem_ratio``
            without it; torch.distributed not initialized, this rank not in ``process_group``, a
            2-D mesh with other dims; no trainable params, params on several devices or the meta
            device (named), non-leaf, sparse or complex params; an optimizer that already holds state.
            Then on every rank: ranks passing different options, param group settings (``lr``, ...)
            or params (named, with both values). Then the wrapped optimizer's ``step()`` raises. ``docs/api.md`` lists every check.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        stage: int = 2,
        process_group: ProcessGroup | DeviceMesh | None = None,
        bucket_size_mb: float = 25.0,
        overlap_comm: bool = True,
        reduce_dtype: torch.dtype | None = None,
        max_grad_norm: float | None = None,
        loss_scale: str | float | DynamicLossScaler | None = None,
        offload: str | None = None,
        gpu_margin_mem_ratio: float = 0.0,
        partition: str | None = None,
        assume_elementwise: bool = False,
        collective_timeout_s: float | None = None,
        overlap_param_gather: bool = True,
        master_weights: bool = True,
    ) -> None:
        if isinstance(optimizer, ShardedOptimizer):
            raise TypeError("optimizer is already a ShardedOptimizer; wrap the plain torch optimizer once")
        self.partition, self.groups = check_construction(
            optimizer, process_group, stage=stage, bucket_size_mb=bucket_size_mb, overlap_comm=overlap_comm, reduce_dtype=reduce_dtype,
            max_grad_norm=max_grad_norm, loss_scale=loss_scale, offload=offload, gpu_margin_mem_ratio=gpu_margin_mem_ratio, partition=partition,
            assume_elementwise=assume_elementwise, collective_timeout_s=collective_timeout_s, overlap_param_gather=overlap_param_gather,
            master_weights=master_weights)
        DelegatingOptimizer.__init__(self, optimizer)
        self.stage = stage
        self.process_group = self.groups.shard
        self.world_size = self.groups.shard_size
        self.rank = dist.get_rank(self.process_group)
        self.bucket_size_mb = float(bucket_size_mb)
        self.offload = offload
        self.overlap_comm = overlap_comm
        self.reduce_dtype = reduce_dtype
        self.collective_timeout_s = collective_timeout_s
        self._timeout = None if collective_timeout_s is None else datetime.timedelta(seconds=collective_timeout_s)

        self._shard_set = ShardSet(optimizer, self.groups, self.bucket_size_mb, host_master=offload is not None,
                                   partition=self.partition, master_weights=master_weights)
        self._shards = self._shard_set.shards  # the same list, grown in place
        self.built = next(_BUILT)  # construction order, alike on every rank (zeroshard.clip_grad_norm_)
        self._consolidated: dict[str, Any] | None = None  # full state, on the consolidate_state_dict rank
        self._since_consolidation = False  # consolidate_state_dict() since the last step (state_dict.py)
        self._issued: dict[int, weakref.ref] = {}  # id -> tensor, those the last state_dict() returned
        self.max_grad_norm = max_grad_norm
        self.grad_norm: Tensor | None = None  # 0-dim fp32 (fp64 params: fp64): last pre-clip global norm, unscaled
        self._step_was_skipped = False
        self._pending: PendingSkip | None = None  # the last device-decided step's overflow flag (kept once read)
        self._skipped_steps = 0
        self._stats: GradStats | ReducedStats | None = None  # from clip_grad_norm_, for the coming step
        self._clip_norm: float | None = None  # max_norm of a clip_grad_norm_, for the coming step
        self._gather = ParamGather(self.process_group, self._timeout, overlap=overlap_param_gather)
        weakref.finalize(self, self._gather.wait)  # dropped mid-gather: complete, let the guard go
        self._reducer = GradReducer(
            self._shard_set.add_groups(range(len(optimizer.param_groups))), stage=stage, groups=self.groups, reduce_dtype=reduce_dtype,
            overlap_comm=overlap_comm, timeout=self._timeout,
        )
        self._reducer.grow = weak_method(self._shard_unfrozen)
        self._fused = FusedAdam(optimizer, kind) if master_weights and (kind := fused_adam_kind(optimizer)) else None
        self.gpu_margin_mem_ratio = float(gpu_margin_mem_ratio)
        if gpu_margin_mem_ratio > 0 and self._fused is not None:  # with offload (checked): the fused update
            self._fused.start_margin_trace(self._shards[0].buffer.device, self.gpu_margin_mem_ratio)
        self._note_scaled_losses()
        self._scaler, self._static_scale = choose_loss_scale(loss_scale, fp16=any(s.buffer.dtype == torch.float16 for s in self._shards))
        if self._scaler is not None:
            coordinator_of(self.process_group).note_dynamic_scale(self, self._scaler, self._reducer)
        refuse_direct_steps(optimizer)  # only step() steps it now
        if self.rank == 0:
            logger.info("%s", self._shard_set.layout_summary(stage))

    # -- partitioning --

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the wrapped optimizer and shard it (a collective: call on every rank).

        Mirrors ``torch.optim.Optimizer.add_param_group``: the group's defaults come from the
        wrapped optimizer. Existing groups keep their layout and state; the new group gets flat
        buffers, buckets and virtual parameters of its own.

        Gradients the new params got in a backward of this step (this rank's own) are reduced at
        once, as DDP's were: a clip and ``step()`` see the average. Params unfrozen before are sharded
        first (a resume repeating the calls gets the saved layout).

        Raises:
            TypeError, ValueError: as ``torch.optim.Optimizer.add_param_group`` does, and for the
                param checks of the constructor. On error the optimizer is left as it was (the unfrozen aside).
        """
        self.wait_params()
        if self._shard_unfrozen():
            self._reduce_added()  # before the group's checks, which may raise
        shards = self._shard_set.add_param_group(param_group)
        for shard in shards:
            self._reducer.add_shard(shard)
        if shards:
            self._reduce_added()

    # -- training --

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Context manager: backward passes inside accumulate gradients locally, with no communication.

        Mirrors ``DistributedDataParallel.no_sync``. The first backward outside the block (or
        ``step()``, whichever comes first) reduces everything accumulated, so the result equals
        one large batch.
        """
        return self._reducer.no_sync()

    # GradScaler.step() sets grad_scale and found_inf on this optimizer and calls step(), which
    # unscales and checks the gradients over every rank (zeroshard/grad/amp.py).
    _step_supports_amp_scaling = True

    def scale_loss(self, loss: Tensor) -> Tensor:
        """``loss`` times the loss scale (``loss`` when none is active), with no host read.

        A scale kept on the device multiplies as a float would: in fp32 for a 16-bit ``loss``.
        """
        SCALED_LOSSES[0] += 1  # step() unscales (_unscaled_backward)
        scale = self._loss_scale_value()
        if not isinstance(scale, Tensor):
            return loss if scale is None else loss * scale
        compute = torch.float32 if loss.dtype in (torch.float16, torch.bfloat16) else loss.dtype
        # a copy: the graph must not hold the state the step updates
        return (loss.to(compute) * scale.to(loss.device, compute, copy=True)).to(loss.dtype)

    def backward(self, loss: Tensor) -> None:
        """``scale_loss(loss).backward()``: use it instead of ``loss.backward()`` whenever a loss scale is active."""
        self.scale_loss(loss).backward()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the coming step's gradients to global norm ``max_norm``; return the pre-clip norm.

        Mirrors ``torch.nn.utils.clip_grad_norm_``: the norm spans all shards and ranks, each
        (tied) param counted once, unscaled by the loss scale. Call it after the backward passes
        and before ``step()``, on every rank (one all-reduce, which ``step()`` then reuses). The
        coefficient ``min(1, max_norm / (norm + 1e-6))`` is applied inside the step; a
        non-finite norm skips the step.

        Raises:
            ValueError: ``max_norm`` not positive, or ``norm_type`` not 2 or inf.
            RuntimeError: as :meth:`step`'s (a timeout; ranks that clip or set an lr differently).
        """
        if not max_norm > 0:
            raise ValueError(f"max_norm={max_norm!r} must be positive")
        if float(norm_type) not in NORM_TYPES:
            raise ValueError(f"norm_type={norm_type!r} must be 2.0 or inf")
        stats = self._gather_stats(float(norm_type), "clip_grad_norm_()", float(max_norm))
        self._clip_norm, self._clip_task = float(max_norm), self._reducer.followed_task
        if self._on_device(stats):  # step() decides again: a GradScaler may step in since
            stats.check()  # as read() does
            self._stats = stats
            scale = self._loss_scale_value()  # no GradScaler (_on_device): the loss scale, maybe on the device
            return unscale(stats.norm(), 1.0 if scale is None else scale).to(stats.dtype)
        self._stats = stats.read()
        return torch.tensor(self._stats.norm / self._gradient_scale(), dtype=self._stats.dtype)

    def use_joint_norm(self, total: float) -> None:
        """After :meth:`clip_grad_norm_`: clip to ``total``, several optimizers' global norm (:func:`zeroshard.clip_grad_norm_`).

        A non-finite ``total`` skips the step; after ``GradScaler.unscale_`` its check decides.

        Raises:
            RuntimeError: no :meth:`clip_grad_norm_` since the last step.
        """
        if self._stats is None:
            raise RuntimeError("use_joint_norm() needs a clip_grad_norm_() since the last step()")
        if isinstance(self._stats, ReducedStats):
            self._stats = self._stats.read()
        joint = total * self._gradient_scale()
        self._stats = replace(self._stats, clip_norm=joint) if self._shard_set.amp.unscaled else replace(self._stats, norm=joint)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduce what is left, update this rank's shard, all-gather the params.

        One all-reduce gives the global gradient norm, the overflow check and which params got a
        gradient on any rank. On inf/NaN every rank skips the update (params and state stay
        byte-identical), the loss scale backs off and ``step_was_skipped`` is set. Otherwise the
        gradients are multiplied by ``1/loss_scale`` times the clip coefficient (``max_grad_norm``
        or a preceding :meth:`clip_grad_norm_`) and Adam/AdamW take the fused one-pass update;
        other optimizers run their own ``step()`` on the virtual params. A param that got no
        gradient on any rank is skipped, its state untouched, as in ``torch.optim``. Gradients
        are consumed: only ``model.zero_grad()`` — or nothing — is needed between steps.
        Collective: call on every rank.

        Raises:
            RuntimeError: a ``torch.amp.GradScaler`` drives it while ``loss_scale`` is active; with
                ``collective_timeout_s``, a collective that some rank did not join in time (named;
                the process group is unusable afterwards); where the host reads the statistics (CPU,
                a timeout), ranks that clip or set an lr differently (on every rank).

        Returns:
            The closure's loss, or ``None``.
        """
        if torch.compiler.is_compiling():  # compiled: the body eagerly (hooks ran)
            return eager_step(ShardedOptimizer._step, self, closure)
        return self._step(closure)

    def _step(self, closure: Callable[[], Any] | None) -> Any:
        self._shard_set.amp.check_one_scale(self, self._loss_scale_value())  # raises before any collective
        self._settle()
        self.wait_params()
        coordinator_of(self.process_group).check_one_overflow_decision(self)
        if self._reducer.closed:
            raise RuntimeError(f"this ShardedOptimizer cannot step: {self._reducer.closed_because}")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for shard in self._shards:  # before any collective: raises alike on every rank
                shard.follow_all()
            if self._fused is not None:
                self._fused.check_state(self._shards, self._shard_set.param_steps)
            stats = self._step_stats()
            if isinstance(stats, ReducedStats) and not self._on_device(stats):  # the one host read (or GradScaler after clip_grad_norm_)
                stats = stats.read()
            if self._fused is not None and (placed := self._fused.place_once(self._shards, lambda: self.memory_usage().device_bytes)):
                if self.rank == 0:
                    logger.info("%s", placed.summary())
            if isinstance(stats, ReducedStats):
                self._update_on_device(stats)
            else:  # the scale read after the statistics' device read (GradScaler, CUDA: no 2nd wait)
                self._update_on_host(stats, self._gradient_scale())
            self._reducer.reset()
            self._stats = self._clip_norm = self._consolidated = None
            self._note_scaled_losses()
            self._since_consolidation = False
        return loss

    @property
    def placement(self) -> Placement | None:
        """Where ``gpu_margin_mem_ratio`` put this rank's chunks at the first ``step()`` (see :class:`~zeroshard.Placement`); else ``None``.

        The first iteration's measured margin, and per chunk its bytes and whether it is on the
        device. Placement happens once.
        """
        return self._fused.placement if self._fused is not None else None

    def wait_params(self) -> None:
        """Wait for the last :meth:`step`'s param all-gathers (CUDA: order the current stream after them).

        Torch code needs no call: any torch function given a param (the forward, ``state_dict()``,
        an EMA copy) waits for its bucket (``zeroshard/gather/param_gather.py``). Call it before other
        reads: a C++ extension bound without torch's dispatcher, or a param alias made before the
        step. No collective.

        Raises:
            RuntimeError: with ``collective_timeout_s``, an all-gather some rank did not join in time.
        """
        self._gather.wait()
        pop_guard_if_done()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients as ``torch.optim.Optimizer.zero_grad`` does, and drop what zeroshard holds of them.

        ``set_to_none=False`` leaves zero gradients: the next step updates every param holding one
        (weight decay, moments), as ``torch.optim`` does. ``model.zero_grad()`` is followed alike.
        """
        self._reducer.reset()
        self._shard_set.zero_grad(set_to_none)
        self._shard_set.amp.clear()
        self._stats = self._clip_norm = None
        self._note_scaled_losses()

    def close(self) -> None:
        """Remove this optimizer's gradient hooks from the params and give the params up (idempotent).

        Afterwards :meth:`step` raises. So do garbage collection and another ``ShardedOptimizer``
        built on the same params. The params keep their values.
        """
        self.wait_params()
        self._reducer.close()

    # -- introspection and state --

    def memory_usage(self) -> MemoryUsage:
        """Bytes this optimizer owns on this rank: flat params, gradient buffers, shards, optimizer state."""
        return owned_memory(self._shards, self._reducer.grad_buffers(), self.optimizer, self._shards[0].buffer.device)

    def __repr__(self) -> str:
        return f"ShardedOptimizer(stage={self.stage}, world_size={self.world_size}, rank={self.rank}, optimizer={self.optimizer!r})"

