"""``DynamicLossScaler``: the loss scale for fp16 training, grown while steps are finite, backed off on overflow.

Follows ColossalAI's ``DynamicGradScaler`` and Megatron-LM's ``DynamicGradScaler`` (growth
interval with hysteresis), with ``torch.amp.GradScaler``'s names (``growth_factor``,
``backoff_factor``, ``growth_interval``).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("zeroshard")


class DynamicLossScaler:
    """A loss scale that doubles after ``growth_interval`` finite steps and halves on overflow.

    On an overflow the step is skipped and ``hysteresis`` counts down; when it reaches zero the
    scale is multiplied by ``backoff_factor`` (not below ``min_scale``), and every further overflow
    backs off again until a growth resets the count. After ``growth_interval`` consecutive finite
    steps the scale is multiplied by ``growth_factor`` (not above ``max_scale``).

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

    def __init__(
        self,
        initial_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
    ) -> None:
        checks = {
            "growth_factor": growth_factor > 1,
            "backoff_factor": 0 < backoff_factor < 1,
            "growth_interval": isinstance(growth_interval, int) and growth_interval >= 1,
            "hysteresis": isinstance(hysteresis, int) and hysteresis >= 1,
            "min_scale": 0 < min_scale <= initial_scale,
            "max_scale": initial_scale <= max_scale,
        }
        values = dict(growth_factor=growth_factor, backoff_factor=backoff_factor, growth_interval=growth_interval,
                      hysteresis=hysteresis, min_scale=min_scale, max_scale=max_scale)
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"DynamicLossScaler: {name}={values[name]!r} is out of range (initial_scale={initial_scale!r})")
        self.scale = float(initial_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self._growth_tracker = 0  # finite steps since the last growth or overflow
        self._hysteresis_tracker = hysteresis  # overflows left before backing off

    def update(self, found_inf: bool) -> None:
        """Account for one step: ``found_inf`` says whether its gradients overflowed."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale = min(self.scale * self.growth_factor, self.max_scale)

    def state_dict(self) -> dict[str, Any]:
        """The scale and both trackers (plain Python numbers), as ``torch.amp.GradScaler.state_dict``."""
        return {"scale": self.scale, "growth_tracker": self._growth_tracker, "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values.

        Raises:
            ValueError: a key is missing or the scale is not positive.
        """
        missing = {"scale", "growth_tracker", "hysteresis_tracker"} - set(state_dict)
        if missing or not float(state_dict["scale"]) > 0:
            raise ValueError(f"DynamicLossScaler.load_state_dict: expected a positive 'scale' and both trackers, got {state_dict!r}")
        self.scale = float(state_dict["scale"])
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])

    def __repr__(self) -> str:
        return f"DynamicLossScaler(scale={self.scale}, growth_interval={self.growth_interval}, hysteresis={self.hysteresis})"


def choose_loss_scale(loss_scale: str | float | DynamicLossScaler | None, fp16: bool) -> tuple[DynamicLossScaler | None, float | None]:
    """``(dynamic scaler, static scale)`` for ``ShardedOptimizer(loss_scale=...)`` (at most one is not ``None``).

    A ``DynamicLossScaler`` is used as given; ``"dynamic"``, or ``None`` with ``fp16`` params, gets
    a fresh one with the defaults (as DeepSpeed enables dynamic scaling for fp16); a number is a
    static scale. ``loss_scale`` was validated by the constructor's checks.
    """
    if isinstance(loss_scale, DynamicLossScaler):
        return loss_scale, None
    if loss_scale == "dynamic" or (loss_scale is None and fp16):
        return DynamicLossScaler(), None
    return None, float(loss_scale) if isinstance(loss_scale, (int, float)) else None


def log_skip(skipped_steps: int, loss_scale: float | None, rank: int) -> None:
    """Log (rank 0) that ``skipped_steps`` steps were skipped for inf/NaN so far, at 1, 2, 4, 8, ... of them.

    With a loss scale a skip is how the scale is found (INFO); without one (fp32, bf16) the model made
    inf/NaN gradients, which DDP + the optimizer would have written into the params (WARNING).
    """
    if rank != 0 or skipped_steps & (skipped_steps - 1):
        return
    if loss_scale is None:
        logger.warning("zeroshard: %d steps skipped so far for inf/NaN gradients with no loss scale active (the params and state are "
                       "unchanged; DDP + the optimizer would have written the inf/NaN into them): check the model and the data",
                       skipped_steps)
    else:
        logger.info("zeroshard: %d steps skipped so far for inf/NaN gradients; loss scale now %s", skipped_steps, loss_scale)
