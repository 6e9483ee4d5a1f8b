"""``torch.amp.GradScaler`` driving a ``ShardedOptimizer``: the scale it applied, the overflow it is told.

The AMP recipe (``scaler.scale(loss).backward()``, optionally ``scaler.unscale_(opt)`` and a clip,
``scaler.step(opt)``, ``scaler.update()``) runs unchanged, as it does under HF Trainer's and
accelerate's ``fp16`` and Lightning's ``"16-mixed"``. A GradScaler checks and unscales the
optimizer's gradients itself, rank by rank; here no rank holds them whole, so zeroshard takes the
two calls over:

* ``scaler.unscale_(opt)`` (and the check ``scaler.step`` runs when ``unscale_`` was not called)
  reaches the virtual params' between-step gradients (``VirtualGrad`` s, views of the grad shard):
  they are unscaled in place, as torch does, so a clip after it (``torch.nn.utils.clip_grad_norm_``
  or ``opt.clip_grad_norm_``) measures unscaled gradients; the ``found_inf`` flags it fills are
  this rank's, and are handed to this link to get every rank's answer at ``step()``.
* ``scaler.step(opt)`` calls ``opt.step()`` (``_step_supports_amp_scaling``), which divides by the
  GradScaler's scale, checks for inf/NaN over every rank (the one all-reduce of the step) and
  writes the answer into the ``found_inf`` tensors the GradScaler reads in ``update()``: every rank
  skips together and every rank's scale backs off alike.

This follows the contract ``GradScaler.step`` documents for optimizers with
``_step_supports_amp_scaling``: it sets ``grad_scale`` (the scale, unless ``unscale_`` ran) and
``found_inf`` on the optimizer for the duration of ``step()``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor


class GradScalerLink:
    """What a ``torch.amp.GradScaler`` handed one ``ShardedOptimizer`` since its last step."""

    def __init__(self) -> None:
        self.found_infs: list[Tensor] = []  # 1-element fp32, the GradScaler's per-device flags, read by its update()
        self.unscaled = False  # a GradScaler's unscale_ (or its check in step()) ran on the gradients since the last step

    def note_unscale(self, found_inf: Tensor) -> None:
        """``torch._amp_foreach_non_finite_check_and_unscale_`` ran on the virtual params' gradients: keep its flag for :meth:`finish_step`."""
        self.found_infs.append(found_inf)
        self.unscaled = True

    def scale(self, optimizer: Any) -> float | None:
        """The GradScaler's scale of the current gradients, or ``None`` when no GradScaler is driving this step.

        Inside ``GradScaler.step``, ``optimizer.grad_scale`` is its scale if ``unscale_`` was not
        called; after ``unscale_`` the gradients are unscaled: 1.0.
        """
        grad_scale = getattr(optimizer, "grad_scale", None)
        if grad_scale is not None:
            return float(grad_scale)
        return 1.0 if self.unscaled else None

    def check_one_scale(self, optimizer: Any, loss_scale: float | Tensor | None) -> None:
        """Raise if a GradScaler and ``loss_scale`` both scale ``optimizer``'s gradients; reads no device value.

        Raises:
            RuntimeError: both scale them (the hand-over is forgotten, so the next step starts clean).
        """
        if loss_scale is not None and (getattr(optimizer, "grad_scale", None) is not None or self.unscaled):
            self.clear()
            raise RuntimeError(f"a torch.amp.GradScaler and loss_scale={float(loss_scale)} both scale this ShardedOptimizer's gradients: "
                               "use one (loss_scale=None with the GradScaler, or opt.backward(loss) without it)")

    def gradient_scale(self, optimizer: Any, loss_scale: float | None) -> float:
        """What ``optimizer``'s gradients are multiplied by: ``loss_scale`` or the GradScaler's scale; 1.0 for neither.

        On CUDA, reading the GradScaler's scale waits for the device: ``step()`` reads it after the
        gradient statistics, whose read waited already.

        Raises:
            RuntimeError: both scale them (:meth:`check_one_scale`).
        """
        self.check_one_scale(optimizer, loss_scale)
        return self.scale(optimizer) or loss_scale or 1.0

    def finish_step(self, found_inf: bool) -> None:
        """Tell the GradScaler whether any rank's gradients had inf/NaN (its ``update()`` reads it), and forget the step."""
        if found_inf:
            for flag in self.found_infs:
                flag.fill_(1.0)
        self.clear()

    def clear(self) -> None:
        """Forget what the GradScaler handed over (a dropped batch)."""
        self.found_infs.clear()
        self.unscaled = False
