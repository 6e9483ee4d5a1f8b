"""One overflow decision for several ``ShardedOptimizer`` s with dynamic loss scales over one model.

See :func:`check_one_overflow_decision`; ``zeroshard.clip_grad_norm_`` makes the joint decision.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

logger = logging.getLogger("zeroshard")



class Scaled(Protocol):
    """What the overflow check reads of a ``ShardedOptimizer``'s gradient reducer."""

    @property
    def closed(self) -> bool: ...

    def local_used(self) -> list[list[bool]]: ...


# ShardedOptimizers with a dynamic loss scale -> (the scaler, their reducer); those clip_grad_norm_ last gathered together.
_SCALED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_JOINT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> ids of the optimizers of its last joint clip


def note_dynamic_scale(opt: Any, scaler: Any, reducer: Scaled) -> None:
    """Record that ``opt`` updates the dynamic loss scale ``scaler`` (a ``DynamicLossScaler``) from the gradients of ``reducer``.

    See :func:`check_one_overflow_decision`.
    """
    _SCALED[opt] = (scaler, reducer)


def check_one_overflow_decision(opt: Any) -> None:
    """At the start of ``opt.step()``: raise if another open ``ShardedOptimizer`` with a dynamic loss
    scale shares ``opt``'s process group and this step's gradients were not checked together.

    Others count when gradients of this step wait for their own ``step()`` (the user calls the
    wrappers' steps in one order on every rank, and each wrapper's params get gradients on every
    rank). Each wrapper's scaler decides alone whether its gradients overflowed. Two wrappers over one
    model (one loss, scaled once) that decide differently would step one and skip the other, and
    their scales would drift apart, so that one divides its gradients by a scale they were not
    multiplied by: wrong numbers, no error. :func:`clip_grad_norm_` over all of them makes one
    decision for all. Raised on every rank alike, before any collective.

    Raises:
        RuntimeError: naming the way out.
    """
    joint = _JOINT.pop(opt, frozenset())
    if opt not in _SCALED:
        return
    # Others whose gradients wait for their own step now: not one dropped and not yet collected
    # (no collection here: a finalizer may run collectives, at different times on different ranks).
    others = [o for o, (_, reducer) in list(_SCALED.items()) if o is not opt and o.process_group is opt.process_group and not reducer.closed
              and id(o) not in joint and any(any(flags) for flags in reducer.local_used())]
    if others:
        raise RuntimeError(
            f"{len(others) + 1} open ShardedOptimizers with a dynamic loss scale share one process group (one model, two optimizers?): "
            "each would decide alone whether the gradients overflowed, and their loss scales would drift apart. Before their "
            "step()s, call zeroshard.clip_grad_norm_(optimizers, max_norm) over all of them every step (max_norm=math.inf to "
            "check for overflow without clipping)"
        )


def note_joint(optimizers: Sequence[Any]) -> None:
    """``zeroshard.clip_grad_norm_`` gathered the gradients of ``optimizers`` together for their coming steps."""
    ids = frozenset(id(o) for o in optimizers)
    for opt in optimizers:
        _JOINT[opt] = ids


def scaler_in_use(scaler: Any) -> bool:
    """Whether an open ``ShardedOptimizer`` already updates ``scaler`` (a ``DynamicLossScaler``) at its steps."""
    return any(s is scaler and not reducer.closed for s, reducer in list(_SCALED.values()))


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
