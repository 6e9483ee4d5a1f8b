"""Per-rank bytes of params, gradients and Adam state, as the ZeRO paper counts them.

Rajbhandari et al., "ZeRO", SC'20, §5 (Figure 1): with Ψ params, N data-parallel ranks and
mixed-precision Adam (16-bit params and gradients; fp32 master, exp_avg, exp_avg_sq: K = 12):
DDP 16Ψ, stage 1 ``2Ψ + 2Ψ + 12Ψ/N``, stage 2 ``2Ψ + (2 + 12)Ψ/N``. In fp32 the params are the
master weights (4 + 4 bytes, K = 8): DDP 16Ψ, stage 1 ``4Ψ + 4Ψ + 8Ψ/N``, stage 2 ``4Ψ + (4 + 8)Ψ/N``.
"""

from __future__ import annotations


def zero_bytes(numel: int, world_size: int, stage: int, mixed_precision: bool) -> float:
    """Bytes per rank for params + gradients + Adam state.

    Args:
        numel: Ψ, trainable elements.
        world_size: N, the sharding degree (>= 1).
        stage: 0 (DDP: nothing sharded), 1 (optimizer state) or 2 (also gradients).
        mixed_precision: 16-bit params and gradients with fp32 master weights, or all fp32.

    Raises:
        ValueError: on a stage outside {0, 1, 2} or a world size below 1.
    """
    if stage not in (0, 1, 2):
        raise ValueError(f"stage={stage} must be 0, 1 or 2")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    param = grad = 2 if mixed_precision else 4
    state = 12 if mixed_precision else 8
    if stage == 0:
        return (param + grad + state) * numel
    if stage == 1:
        return (param + grad) * numel + state * numel / world_size
    return param * numel + (grad + state) * numel / world_size
