"""How :class:`~zeroshard.ShardedOptimizer` applies an update once the gradient statistics are in: decided on the host after
the step's one host sync, or on the device with no host sync (:meth:`UpdateMixin._on_device`). See docs/numerics.md, "One step"."""

from __future__ import annotations

import datetime
import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from zeroshard.comm.groups import ShardingGroups
from zeroshard.gather.param_gather import ParamGather
from zeroshard.layout.local_shard import LocalShard
from zeroshard.reduce.grad_reducer import GradReducer
from zeroshard.reduce.records import StepPhase
from zeroshard.shard_set import ShardSet
from zeroshard.step.fused_adam import FusedAdam, takes_device_scalars
from zeroshard.step.grad_norm import GradStats, ReducedStats, reduce_grad_stats
from zeroshard.step.loss_scaler import DynamicLossScaler, log_skip
from zeroshard.step.pending_skip import PendingSkip, device_multiplier, unscale
from zeroshard.step.wrapped import grad_multiplier, step_as_wrapped, wrapped_step

# How many losses any ShardedOptimizer of this process scaled (scale_loss): one backward may carry several optimizers'
# gradients (Muon + AdamW over one model), each of which takes its gradients as scaled when this moved since its last step.
SCALED_LOSSES = [0]

_COMPILED = ("zeroshard: ShardedOptimizer.step() runs outside compiled frames (its collectives and gradient bookkeeping cannot be "
             "traced): call it outside the torch.compile(fullgraph=True) function; compile the model itself (torch.compile(model))")


def _run(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


# Made at import where Dynamo is loaded (transformers, Lightning load it; importing it takes seconds), else at the first use, in
# traced code (a fullgraph=True function then fails at torch.compiler.disable itself, which Dynamo skips).
_EAGER = [torch.compiler.disable(_run, reason=_COMPILED)] if "torch._dynamo" in sys.modules else []


def eager_step(step: Callable[..., Any], optimizer: object, closure: Callable[[], Any] | None) -> Any:
    """``step(optimizer, closure)`` outside Dynamo's frames, where Dynamo traces ``ShardedOptimizer.step`` (a compiled training
    step): one graph break there, as ``torch.compiler.disable`` gives (``fullgraph=True``: Dynamo's ``Unsupported``, this reason)."""
    if not _EAGER:
        _EAGER.append(torch.compiler.disable(_run, reason=_COMPILED))
    return _EAGER[0](step, optimizer, closure)


class UpdateMixin:
    """The update of :class:`~zeroshard.ShardedOptimizer`'s step, on the host's or the device's statistics."""

    # What the host (ShardedOptimizer) provides.
    optimizer: torch.optim.Optimizer
    rank: int
    max_grad_norm: float | None
    grad_norm: Tensor | None
    _shard_set: ShardSet
    _shards: list[LocalShard]
    _scaler: DynamicLossScaler | None
    _fused: FusedAdam | None
    _reducer: GradReducer
    _gather: ParamGather
    _clip_norm: float | None
    _clip_task: int  # the reducer's followed_task at clip_grad_norm_()
    _stats: GradStats | ReducedStats | None
    _pending: PendingSkip | None
    _step_was_skipped: bool
    _skipped_steps: int
    _static_scale: float | None
    _scaled_losses_seen: int  # SCALED_LOSSES at the last step() or zero_grad()
    groups: ShardingGroups
    _timeout: datetime.timedelta | None
    process_group: ProcessGroup

    @property
    def loss_scale(self) -> float | None:
        """The current loss scale (dynamic or static), or ``None`` when no loss scaling is active (on CUDA this may wait for the last step)."""
        return self._scaler.scale if self._scaler is not None else self._static_scale

    def _loss_scale_value(self) -> float | Tensor | None:
        """The loss scale this step's gradients carry, without a host read (a device-kept dynamic scale: its 0-dim float64 tensor)."""
        if self._unscaled_backward():
            return None
        return self._scaler.scale_value() if self._scaler is not None else self._static_scale

    def _gradient_scale(self) -> float:
        """What the gradients are multiplied by (see :meth:`GradScalerLink.gradient_scale`)."""
        return self._shard_set.amp.gradient_scale(self, None if self._unscaled_backward() else self.loss_scale)

    def _step_stats(self) -> GradStats | ReducedStats:
        """The step's gradient statistics: those of a :meth:`clip_grad_norm_` since the last step, else reduced now (a collective).

        Raises:
            RuntimeError: a backward reached the gradients after that clip, before any collective (its norm leaves them out).
        """
        if self._stats is None:
            return self._gather_stats(2.0, "step()", self._max_norm())
        self._shard_set.check_param_groups()  # as _gather_stats does
        if self._clip_task != self._reducer.followed_task:
            raise RuntimeError("a backward ran after opt.clip_grad_norm_() and before step(): the clip's norm leaves out its gradients, "
                               "which it would not reduce either; call clip_grad_norm_() after the last backward of the step")
        for shard in self._shards:  # assigned since the clip: taken, and multiplied by its coefficient as edits in place are
            shard.take_replaced_grads()
        return self._stats

    def _gather_stats(self, norm_type: float, caller: str, max_norm: float | None) -> ReducedStats:
        """The statistics, all-reduced and still on the device (:meth:`_on_device`), with the coming step's clip ``max_norm``."""
        self._shard_set.check_param_groups()  # before any collective
        for shard in self._shards:
            shard.take_replaced_grads(write=False)  # a .grad = None raises here, before any collective
        if self._shard_unfrozen():
            self._reducer.accumulate_locally()  # their gradients are still local
        self._reducer.reduce_for_step()
        for shard in self._shards:
            shard.take_replaced_grads()
        return reduce_grad_stats(self._shards, self._reducer.local_used(), self.groups, norm_type, self._timeout, caller, max_norm or 0.0,
                                 self.optimizer)  # its groups' lrs: checked alike on every rank where the host waits anyway

    def _shard_unfrozen(self) -> bool:
        """Shard and hook up the params unfrozen since their group was sharded (:meth:`ShardSet.add_unfrozen`: a collective when
        there are some); whether there were. The group's coordinator also calls it (``GradReducer.grow``) as each reduced
        backward ends, after that pass's collectives, so that their gradients, still this rank's own, are reduced with the
        others: a clip before ``step()`` reads DDP's average."""
        with torch.no_grad():
            unfrozen = self._shard_set.add_unfrozen()
            for shard in unfrozen:
                self._reducer.add_shard(shard)
        return bool(unfrozen)

    def _reduce_added(self) -> None:
        """After shards were added mid-step: if this step's gradients are reduced already, reduce theirs too (still this rank's
        own), so that a clip and ``step()`` see the average, as DDP's."""
        if self._reducer.phase is StepPhase.REDUCED:
            self._reducer.accumulate_locally()
            self._reducer.reduce_for_step()

    def _note_scaled_losses(self) -> None:
        """At a step's end (or ``zero_grad()``): the losses scaled so far are this step's, not the next one's."""
        self._scaled_losses_seen = SCALED_LOSSES[0]

    def _unscaled_backward(self) -> bool:
        """Whether this step's gradients carry no loss scale although one is active (a plain ``loss.backward()``, no GradScaler):
        the step then neither unscales nor moves the scale."""
        scaled = SCALED_LOSSES[0] != self._scaled_losses_seen  # a scale_loss() since
        return (not scaled and (self._scaler is not None or self._static_scale is not None)
                and getattr(self, "grad_scale", None) is None and not self._shard_set.amp.unscaled)

    def _on_device(self, stats: ReducedStats) -> bool:
        """Whether the step can keep the norm, the clip coefficient and the overflow decision on the device: where the Triton
        kernel updates every chunk, no GradScaler needs the decision on the host, every param got a gradient on this rank (the
        used-flags need no reading) and every param was stepped before (a skipped first step must create no state)."""
        return (self._fused is not None and takes_device_scalars(self._shards) and not self._shard_set.amp.unscaled
                and getattr(self, "grad_scale", None) is None and stats.used_everywhere
                and all(self._shard_set.param_steps[i] for shard in self._shards for i in shard.param_indices))

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step was skipped for inf/NaN gradients (on CUDA this may wait for that step's flag)."""
        self._settle()
        return self._step_was_skipped

    def _settle(self) -> None:
        """Read the last step's device overflow flag, if still pending; take back the counts of a skipped step."""
        pending = self._pending  # kept once read: the next step's PendingSkip reuses its buffer
        if pending is None or pending.read or not pending.skipped():
            return
        self._step_was_skipped = True
        self._shard_set.count_steps([[step > 0 for step in shard] for shard in pending.steps], -1)
        if self._fused is not None:
            self._fused.undo_step_counts(self._shards, pending.steps)
        self._skipped_steps += 1
        log_skip(self._skipped_steps, lambda: pending.loss_scale() or self.loss_scale, self.rank)

    def _update_on_device(self, stats: ReducedStats) -> None:
        """The step with the norm, clip coefficient, overflow flag and loss scale on the device (:meth:`_on_device`): no host sync
        (where the host waited for the statistics anyway, CPU or ``collective_timeout_s``, it checks that the ranks agree first)."""
        stats.check()  # the ranks whose host decides (a param without a gradient there) check too: every rank raises alike
        norm = stats.norm()
        if self._scaler is not None:
            self._scaler.to_device(norm.device)
        value = self._loss_scale_value()  # a float, or the dynamic scale's device tensor (no GradScaler: _on_device)
        scale = 1.0 if value is None else value
        unscaled = unscale(norm, scale)
        self.grad_norm = unscaled.to(stats.dtype)
        # The norm is never negative: not below inf is inf or NaN. Two kernels where ~isfinite(norm).float() takes six.
        found_inf = torch.where(norm < math.inf, 0.0, 1.0).float().reshape(1)  # fp32 whatever the default dtype
        used = stats.local_used  # every param got a gradient on this rank (_on_device)
        steps = self._update(used, device_multiplier(unscaled, scale, self._max_norm()), found_inf)
        if self._scaler is not None and value is not None:
            self._scaler.update(found_inf)  # after the multiplier was taken from the scale of this step's gradients
        self._step_was_skipped = False
        scale_now = self._scaler.scale_value() if self._scaler is not None else None  # the device tensor, as updated
        self._pending = PendingSkip(found_inf, steps, scale_now if isinstance(scale_now, Tensor) else None, reuse=self._pending)
        self._reducer.drop_unused_grads(used)

    def _update_on_host(self, stats: GradStats, scale: float) -> None:
        """The step on the statistics read back: skip on overflow (backing off a dynamic loss scale), else update."""
        self.grad_norm = torch.tensor(stats.pre_clip_norm / scale, dtype=stats.dtype)
        self._step_was_skipped = stats.found_inf
        grad_scaler = self._shard_set.amp.unscaled or getattr(self, "grad_scale", None) is not None  # before finish_step forgets it
        self._shard_set.amp.finish_step(stats.found_inf)
        if self._scaler is not None and not self._unscaled_backward():
            self._scaler.update(stats.found_inf)
        if stats.found_inf:
            self._skipped_steps += 1
            log_skip(self._skipped_steps, lambda: self.loss_scale, self.rank, grad_scaler)
            if self._fused is not None:  # a rank that kept the decision on the device all-gathers (unchanged params): join it
                self._gather.launch(self._shards)
        elif any(any(flags) for flags in stats.used):
            self._update(stats.used, grad_multiplier(stats.pre_clip_norm, scale, self._max_norm()))
        self._reducer.drop_unused_grads(stats.used)

    def _max_norm(self) -> float | None:
        """The clip norm of the coming step: a ``clip_grad_norm_`` call's, else ``max_grad_norm``."""
        return self._clip_norm if self._clip_norm is not None else self.max_grad_norm

    def _update(self, used: list[list[bool]], multiplier: float | Tensor, found_inf: Tensor | None = None) -> list[list[int]]:
        """Count the step, update every used param, launch the all-gather; the step numbers used (per shard, per param)."""
        steps = self._shard_set.count_steps(used)
        for shard in self._shards:
            shard.refresh_master()
        if self._fused is not None:  # as the wrapped optimizer's step: its own hooks run, a scheduler built on it sees the step
            fused = self._fused
            step_as_wrapped(self.optimizer, lambda: fused.step(self._shards, steps, multiplier, found_inf))
        else:  # only with a float multiplier (_on_device needs the fused update)
            wrapped_step(self.optimizer, self._shards, used, multiplier)  # type: ignore[arg-type]
        self._gather.launch(self._shards)  # waited for before the params are next read (param_gather.py)
        return steps

