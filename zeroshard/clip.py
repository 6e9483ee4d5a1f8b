"""One global gradient-norm clip over several ``ShardedOptimizer`` s of one model (the Muon + AdamW recipe)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from zeroshard.optimizer import ShardedOptimizer
from zeroshard.reduce.coordinator import coordinator_of


def clip_grad_norm_(optimizers: Iterable[ShardedOptimizer] | ShardedOptimizer, max_norm: float, norm_type: float = 2.0) -> Tensor:
    """Clip the coming step of ``optimizers`` to one global norm ``max_norm``; return the pre-clip norm.

    ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` for a model whose params are split between several
    wrappers, e.g. ``torch.optim.Muon`` for the hidden matrices and ``torch.optim.AdamW`` for the rest: each wrapper's
    :meth:`~ShardedOptimizer.clip_grad_norm_` gives the norm of its own params (one all-reduce each), and all of them then
    clip by the norm over every param, ``(sum of norm_i ** 2) ** 0.5`` (the largest for ``inf``), unscaled by each one's
    loss scale. A non-finite norm skips the coming step of every one of them, except of those a ``torch.amp.GradScaler``
    has unscaled (``scaler.unscale_(opt)``): as torch optimizers under one GradScaler, each of them skips on inf/NaN in its
    own gradients only, and one whose gradients are finite steps with the global norm's clip coefficient, 0: a step on
    zero gradients (weight decay, moments and step count move on), as after ``torch.nn.utils.clip_grad_norm_`` of an inf
    norm. (Of a NaN norm torch's coefficient is NaN, and that step writes NaN into the params; here it is 0 as well.)
    Call it after the backward passes and before the ``step()`` s, on every rank, with the same optimizers: in any order (or
    as a set), as their norms are taken in the order they were built (``opt.built``, alike on every rank).

    Args:
        optimizers: distinct ``ShardedOptimizer`` s (over disjoint params, which their construction ensures), or one
            (as ``torch.nn.utils.clip_grad_norm_`` takes one tensor).
        max_norm: the global norm to clip to (> 0).
        norm_type: 2.0 or ``inf``.

    Returns:
        0-dim tensor on the CPU: the global pre-clip norm, fp32 (fp64 when any optimizer's params are fp64).

    Raises:
        TypeError: an entry of ``optimizers`` is not a ``ShardedOptimizer``.
        ValueError: ``optimizers`` is empty or names one twice; ``max_norm`` or ``norm_type`` as
            :meth:`ShardedOptimizer.clip_grad_norm_` raises. All before any collective.
    """
    optimizers = [optimizers] if isinstance(optimizers, ShardedOptimizer) else list(optimizers)
    bad = [type(opt).__name__ for opt in optimizers if not isinstance(opt, ShardedOptimizer)]
    if bad:
        raise TypeError(f"optimizers must be ShardedOptimizers; got {bad}")
    distinct = len({id(opt) for opt in optimizers})
    if not optimizers or distinct != len(optimizers):
        raise ValueError(f"optimizers must be one or more distinct ShardedOptimizers; got {len(optimizers)} entries, {distinct} distinct")
    # The first one's clip_grad_norm_ checks max_norm and norm_type before its collective.
    norms = [opt.clip_grad_norm_(max_norm, norm_type) for opt in sorted(optimizers, key=lambda opt: opt.built)]
    values = [float(n) for n in norms]
    total = max(values) if math.isinf(norm_type) else math.sqrt(sum(v * v for v in values))
    if not all(math.isfinite(v) for v in values):
        total = math.inf
    for opt in optimizers:
        coordinator_of(opt.process_group).note_joint(opt, optimizers)
        opt.use_joint_norm(total)
    return torch.tensor(total, dtype=torch.float64 if any(n.dtype == torch.float64 for n in norms) else torch.float32)
