"""The update of one step once the gradients are reduced, for optimizers other than the fused Adam/AdamW.

See [Note: zeroshard buffers] in ``zeroshard/flat_buffer.py``.

:func:`grad_multiplier` gives what every path multiplies the gradients by; :func:`wrapped_step`
runs the wrapped optimizer's own ``step()`` on the virtual params. Like
:meth:`zeroshard.fused_adam.FusedAdam.step`, it leaves each chunk's slice of the flat param
buffer updated, and ``ShardedOptimizer.step`` then launches the all-gathers (``param_gather.py``).
"""

from __future__ import annotations

import torch

from zeroshard.local_shard import LocalShard


def grad_multiplier(norm: float, loss_scale: float, max_norm: float | None) -> float:
    """What the reduced gradients are multiplied by: ``1 / loss_scale`` times the clip coefficient.

    ``norm`` is the global norm of the still-scaled gradients; the clip coefficient is
    ``min(1, max_norm / (norm / loss_scale + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``.
    """
    coefficient = 1.0 if max_norm is None else min(1.0, max_norm / (norm / loss_scale + 1e-6))
    return coefficient / loss_scale


@torch.no_grad()
def wrapped_step(optimizer: torch.optim.Optimizer, shards: list[LocalShard], used: list[list[bool]], multiplier: float) -> None:
    """Run ``optimizer.step()`` on the virtual params.

    The grad shards are multiplied by ``multiplier`` in place (they are consumed), each virtual
    param's ``.grad`` is its piece of them, or ``None`` where ``used`` (per shard, per param)
    says no rank gave the param a gradient, so the optimizer skips it as ``torch.optim`` does.
    Afterwards 16-bit params receive the cast of their updated fp32 masters (with ``master_weights``;
    without, the virtual params are views of the params themselves and were updated in place).
    """
    for shard, flags in zip(shards, used):
        if multiplier != 1.0:
            shard.grad_shard.mul_(multiplier)
        shard.attach_grads(flags)
    optimizer.step()
    for shard in shards:
        shard.detach_grads()
        shard.write_back()

