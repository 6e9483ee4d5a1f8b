"""Eager torch versions of the fused kernels: the CPU path, the test oracle, the benchmark baseline.

``adamw_reference_`` performs, op for op, the update of ``torch.optim.Adam``/``AdamW``'s
single-tensor implementation (``torch/optim/adam.py``, ``_single_tensor_adam``), so with
``grad_scale=None`` its results are bitwise equal to ``AdamW(foreach=False)`` on the same elements.
"""

from __future__ import annotations

import torch
from torch import Tensor


def adamw_reference_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    param_out: Tensor | None = None,
    maximize: bool = False,
    adamw: bool = True,
) -> None:
    """One Adam/AdamW step in place; see :func:`zeroshard.kernels.fused_adamw_` for the arguments.

    Unlike the Triton kernel, reading ``found_inf`` here synchronizes with the device.
    """
    if found_inf is not None and bool(found_inf):
        return
    g = grad if grad.dtype == param.dtype else grad.to(param.dtype)
    if grad_scale is not None:
        g = g * grad_scale
    if maximize:
        g = -g
    if weight_decay != 0:
        if adamw:
            param.mul_(1 - lr * weight_decay)
        else:
            g = g.add(param, alpha=weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step = float(step)  # torch raises beta to its float step count
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if param_out is not None:
        param_out.copy_(param)


def grad_sumsq_reference(grad: Tensor) -> Tensor:
    """Sum of squares of ``grad`` in fp32 (fp64 for fp64 ``grad``; 0-dim); inf or NaN anywhere makes it non-finite."""
    return grad.to(torch.promote_types(grad.dtype, torch.float32)).square().sum()
