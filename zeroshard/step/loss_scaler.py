"""``DynamicLossScaler``: the loss scale for fp16 training, and the log of skipped steps (docs/numerics.md, "Loss scaling")."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger("zeroshard")


class DynamicLossScaler:
    """A loss scale that doubles after ``growth_interval`` finite steps and halves on overflow.

    On an overflow the step is skipped and ``hysteresis`` counts down; when it reaches zero the scale is multiplied by
    ``backoff_factor`` (not below ``min_scale``), and every further overflow backs off again until a growth resets the count.
    After ``growth_interval`` consecutive finite steps the scale is multiplied by ``growth_factor`` (not above ``max_scale``).
    This follows ColossalAI's and Megatron-LM's ``DynamicGradScaler``, with ``torch.amp.GradScaler``'s names. Like a
    ``GradScaler`` on CUDA, its state can live on the device (:meth:`to_device`), updated there from a device overflow flag.

    Args:
        initial_scale: the first scale (> 0).
        growth_factor: multiplier on growth (> 1).
        backoff_factor: multiplier on backoff (in (0, 1)).
        growth_interval: finite steps between growths (>= 1).
        hysteresis: overflows tolerated before the first backoff (>= 1).
        min_scale, max_scale: bounds of the scale (0 < min_scale <= initial_scale <= max_scale).

    Raises:
        ValueError: an argument outside its range, named with its value.
    """

    def __init__(self, initial_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 1000,
                 hysteresis: int = 2, min_scale: float = 1.0, max_scale: float = 2.0**24) -> None:
        checks = {  # name: (value, in range)
            "growth_factor": (growth_factor, growth_factor > 1),
            "backoff_factor": (backoff_factor, 0 < backoff_factor < 1),
            "growth_interval": (growth_interval, isinstance(growth_interval, int) and growth_interval >= 1),
            "hysteresis": (hysteresis, isinstance(hysteresis, int) and hysteresis >= 1),
            "min_scale": (min_scale, 0 < min_scale <= initial_scale),
            "max_scale": (max_scale, initial_scale <= max_scale),
        }
        for name, (value, ok) in checks.items():
            if not ok:
                raise ValueError(f"DynamicLossScaler: {name}={value!r} is out of range (initial_scale={initial_scale!r})")
        self._scale = float(initial_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self._growth_tracker = 0  # finite steps since the last growth or overflow
        self._hysteresis_tracker = hysteresis  # overflows left before backing off
        self._device_state: Tensor | None = None  # float64 [scale, growth tracker, hysteresis tracker] on the device (to_device)

    @property
    def scale(self) -> float:
        """The current loss scale; where the state lives on a CUDA device, reading it waits for the device."""
        self._pull()
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        self._pull()
        self._scale = float(value)
        self._push()

    def scale_value(self) -> float | Tensor:
        """The current scale without a host read: the 0-dim float64 device tensor where the state lives there, else a float."""
        return self._device_state[0] if self._device_state is not None else self._scale

    def to_device(self, device: torch.device) -> None:
        """Keep the state on ``device`` from now on (idempotent), where :meth:`update` takes a device flag without a host read."""
        if self._device_state is None or self._device_state.device != device:
            self._pull()
            self._device_state = self._host_state().to(device, non_blocking=True)

    def _pull(self) -> None:
        """Read the device state into the host fields (waits for the device)."""
        if self._device_state is not None:
            scale, growth, hysteresis = self._device_state.tolist()
            self._scale, self._growth_tracker, self._hysteresis_tracker = scale, int(growth), int(hysteresis)

    def _push(self) -> None:
        """Write the host fields into the device state."""
        if self._device_state is not None:
            self._device_state.copy_(self._host_state(), non_blocking=True)

    def _host_state(self) -> Tensor:
        """The host fields as the device state's float64 ``[scale, growth tracker, hysteresis tracker]``, pinned where CUDA is available."""
        state = torch.tensor([self._scale, self._growth_tracker, self._hysteresis_tracker], dtype=torch.float64)
        return state.pin_memory() if torch.cuda.is_available() else state

    def update(self, found_inf: bool | Tensor) -> None:
        """Account for one step: ``found_inf`` (a bool, or a device flag: non-zero) says whether its gradients overflowed.

        Where the state lives on the device the update runs there, the same arithmetic in float64, and reads nothing back.
        """
        state = self._device_state
        if state is not None:
            flag = found_inf.reshape(-1)[0] if isinstance(found_inf, Tensor) else torch.full((), float(found_inf), device=state.device)
            scale, growth, hysteresis = state[0], state[1] + 1, state[2] - 1  # growth: if finite; hysteresis: if not
            backed_off = torch.where(hysteresis <= 0, (scale * self.backoff_factor).clamp(min=self.min_scale), scale)
            grow = growth == self.growth_interval
            grown = torch.where(grow, (scale * self.growth_factor).clamp(max=self.max_scale), scale)
            finite = torch.stack([grown, torch.where(grow, 0.0, growth), torch.where(grow, float(self.hysteresis), state[2])])
            state.copy_(torch.where(flag != 0, torch.stack([backed_off, torch.zeros_like(scale), hysteresis]), finite))
            return
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = min(self._scale * self.growth_factor, self.max_scale)

    def state_dict(self) -> dict[str, Any]:
        """The scale and both trackers (plain Python numbers), as ``torch.amp.GradScaler.state_dict``."""
        self._pull()
        return {"scale": self._scale, "growth_tracker": self._growth_tracker, "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values.

        Raises:
            ValueError: a key is missing or the scale is not positive.
        """
        missing = {"scale", "growth_tracker", "hysteresis_tracker"} - set(state_dict)
        if missing or not float(state_dict["scale"]) > 0:
            raise ValueError(f"DynamicLossScaler.load_state_dict: expected a positive 'scale' and both trackers, got {state_dict!r}")
        self._scale = float(state_dict["scale"])
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
        self._push()

    def __repr__(self) -> str:
        return f"DynamicLossScaler(scale={self.scale}, growth_interval={self.growth_interval}, hysteresis={self.hysteresis})"


def choose_loss_scale(loss_scale: str | float | DynamicLossScaler | None, fp16: bool) -> tuple[DynamicLossScaler | None, float | None]:
    """``(dynamic scaler, static scale)`` for ``ShardedOptimizer(loss_scale=...)`` (validated), at most one not ``None``: a
    ``DynamicLossScaler`` as given; a fresh one for ``"dynamic"``, or ``None`` with ``fp16`` params (as DeepSpeed); a number: static."""
    if isinstance(loss_scale, DynamicLossScaler):
        return loss_scale, None
    if loss_scale == "dynamic" or (loss_scale is None and fp16):
        return DynamicLossScaler(), None
    return None, float(loss_scale) if isinstance(loss_scale, (int, float)) else None


def log_skip(skipped_steps: int, loss_scale: Callable[[], float | None], rank: int, grad_scaler: bool = False) -> None:
    """Log (rank 0) that ``skipped_steps`` steps were skipped for inf/NaN so far, at 1, 2, 4, 8, ... of them: INFO with a loss
    scale (``loss_scale()``, called only then: it may wait for the device) or a ``torch.amp.GradScaler``'s (``grad_scaler``),
    WARNING without one (the model made inf/NaN gradients)."""
    if rank != 0 or skipped_steps & (skipped_steps - 1):
        return
    scale = loss_scale()
    if scale is None and grad_scaler:
        logger.info("zeroshard: %d steps skipped so far for inf/NaN gradients; the GradScaler lowers its scale", skipped_steps)
    elif scale is None:
        logger.warning("zeroshard: %d steps skipped so far for inf/NaN gradients with no loss scale active (the params and state are "
                       "unchanged; DDP + the optimizer would have written the inf/NaN into them): check the model and the data",
                       skipped_steps)
    else:
        logger.info("zeroshard: %d steps skipped so far for inf/NaN gradients; loss scale now %s", skipped_steps, scale)
