"""``torch.amp.GradScaler`` driving a ``ShardedOptimizer``: the scale it applied, the overflow it is told.

``scaler.unscale_(opt)`` (or the check in ``scaler.step``) unscales the ``VirtualGrad`` s in place and hands this rank's
``found_inf`` flags to the link; ``scaler.step(opt)`` sets ``grad_scale`` and ``found_inf`` on the optimizer for the duration
of ``opt.step()`` (``_step_supports_amp_scaling``), which decides the overflow over every rank and fills those flags, so
every rank skips and backs off alike. See docs/numerics.md, "Loss scaling".
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
        """What ``optimizer``'s gradients are multiplied by: ``loss_scale``, or the GradScaler's scale (1.0 after its ``unscale_``); 1.0 for neither.

        On CUDA reading ``optimizer.grad_scale`` waits for the device: ``step()`` reads it after the gradient statistics, which waited already.

        Raises:
            RuntimeError: both scale them (:meth:`check_one_scale`).
        """
        self.check_one_scale(optimizer, loss_scale)
        grad_scale = getattr(optimizer, "grad_scale", None)
        scale = float(grad_scale) if grad_scale is not None else 1.0 if self.unscaled else None
        return scale or loss_scale or 1.0

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
