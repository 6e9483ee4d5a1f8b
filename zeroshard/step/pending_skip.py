"""A step whose overflow decision stayed on the device, until the host needs it (docs/numerics.md, "One step").

As under ``torch.amp.GradScaler``, the kernel takes a device flag, ``found_inf``, that turns the update into a no-op; the host
counts the step as taken and a :class:`PendingSkip` remembers what to undo if the flag was set. The flag is copied to pinned
host memory behind an event, so reading it later waits only for that copy, not for work queued since.
"""

from __future__ import annotations

import torch
from torch import Tensor


class PendingSkip:
    """The device's overflow flag of one step, and the step counts it must take back if set.

    Args:
        found_inf: 1-element fp32 device flag (non-zero: the update left params and state untouched).
        steps: per shard, per param: the step number the update used (0: not stepped), as ``count_steps`` returned it.
        loss_scale: a dynamic loss scale kept on the device, as this step's update left it (0-dim float64), copied
            along for the log line of a skip; ``None`` without one.
        reuse: the previous step's, once read (:attr:`read`): its pinned buffer and event are taken over, not made again
            (on an H200, making and reading one took 48 µs of host time with new ones, 32 reusing them; #27).
    """

    _values: Tensor  # the pinned host copy of the flag (and the scale), or the device values themselves off CUDA
    _ready: torch.cuda.Event | None  # recorded after the copy (CUDA only)
    _device: torch.device  # the flag's
    _loss_scale: float | None  # read with the flag

    def __init__(self, found_inf: Tensor, steps: list[list[int]], loss_scale: Tensor | None = None, reuse: PendingSkip | None = None) -> None:
        self.steps = steps
        self._skipped: bool | None = None  # read once
        values = found_inf.reshape(1) if loss_scale is None else torch.stack([found_inf.reshape(()).double(), loss_scale])  # a view: no kernel
        if found_inf.device.type == "cuda":
            if reuse is not None and reuse.read and reuse._ready is not None and reuse._device == found_inf.device \
                    and reuse._values.shape == values.shape and reuse._values.dtype == values.dtype:
                self._values, self._ready = reuse._values, reuse._ready  # nothing copies into them any more: read
            else:
                self._values = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                self._ready = torch.cuda.Event()
            self._values.copy_(values, non_blocking=True)
            self._ready.record()
        else:
            self._values, self._ready = values, None
        self._device = found_inf.device

    @property
    def read(self) -> bool:
        """Whether :meth:`skipped` has read the flag (no copy into this step's buffer is left in flight)."""
        return self._skipped is not None

    def skipped(self) -> bool:
        """Whether the device skipped the update (the first call waits for the flag's copy only)."""
        if self._skipped is None:
            if self._ready is not None:
                self._ready.synchronize()
            # One read of the pinned copy itself (no host sync), the scale with it: a later step reuses the buffer.
            flag, *scale = self._values.tolist()
            self._skipped, self._loss_scale = flag != 0, (scale[0] if scale else None)
        return self._skipped

    def loss_scale(self) -> float | None:
        """The dynamic loss scale after this step's update, as copied with the flag (after :meth:`skipped`); ``None`` without one."""
        self.skipped()
        return self._loss_scale


def device_multiplier(unscaled_norm: Tensor, loss_scale: float | Tensor, max_norm: float | None) -> Tensor:
    """:func:`~zeroshard.step.wrapped.grad_multiplier` on the device: a 1-element fp32 tensor, the host's to the bit.

    ``unscaled_norm``: the 0-dim float64 global norm divided by ``loss_scale`` (a float, or a dynamic scale's 0-dim float64
    device tensor). The clip coefficient is computed in float64, as the host computes it in Python floats.
    """
    if max_norm is None:
        if isinstance(loss_scale, Tensor):
            return (1.0 / loss_scale).float().reshape(1)
        return torch.full((1,), 1.0 / loss_scale, device=unscaled_norm.device, dtype=torch.float32)
    coefficient = (max_norm / (unscaled_norm + 1e-6)).clamp(max=1.0)
    return unscale(coefficient, loss_scale).float().reshape(1)


def unscale(value: Tensor, loss_scale: float | Tensor) -> Tensor:
    """``value / loss_scale``, launching nothing for a float scale of 1.0 (``x / 1.0`` is ``x`` for every float, inf and NaN included)."""
    return value if not isinstance(loss_scale, Tensor) and loss_scale == 1.0 else value / loss_scale
