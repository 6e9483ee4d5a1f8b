"""Checks of ``ShardedOptimizer``'s arguments and params, all run before any collective.

Each raises ``TypeError`` or ``ValueError`` naming the argument and the offending values (the
errors ``torch.distributed.optim.ZeroRedundancyOptimizer`` and ``torch.optim`` raise for the same
mistakes, with the values added).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def check_arguments(optimizer: Any, stage: Any, bucket_size_mb: Any, reduce_dtype: Any) -> None:
    """Raise on an argument ``ShardedOptimizer`` cannot use.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer`` or is already sharded;
            ``reduce_dtype`` is not ``None`` or a floating-point dtype.
        ValueError: ``stage`` not in {1, 2}; ``bucket_size_mb`` not a positive number;
            ``optimizer`` already holds state.
    """
    from zeroshard.optimizer import ShardedOptimizer

    if isinstance(optimizer, ShardedOptimizer):
        raise TypeError("optimizer is already a ShardedOptimizer; wrap the plain torch optimizer once")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer instance, got {type(optimizer).__name__}")
    if stage not in (1, 2):
        raise ValueError(f"stage={stage!r} must be 1 or 2")
    if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)) or not bucket_size_mb > 0:
        raise ValueError(f"bucket_size_mb={bucket_size_mb!r} must be a positive number")
    if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point):
        raise TypeError(f"reduce_dtype={reduce_dtype!r} must be None or a floating-point torch.dtype")
    if optimizer.state:
        raise ValueError(f"optimizer already holds state for {len(optimizer.state)} params; wrap it before its first step and load checkpoints through ShardedOptimizer.load_state_dict")


def check_options(optimizer: torch.optim.Optimizer, max_grad_norm: Any, loss_scale: Any, offload: Any, gpu_margin_mem_ratio: Any) -> None:
    """Raise on a step option ``ShardedOptimizer`` cannot use.

    Raises:
        ValueError: ``max_grad_norm`` neither ``None`` nor positive; ``loss_scale`` not ``None``,
            ``"dynamic"``, a positive number or a ``DynamicLossScaler``; ``offload`` not
            ``None``/``"cpu"``, or ``"cpu"`` with an optimizer other than Adam/AdamW;
            ``gpu_margin_mem_ratio`` outside [0, 1], or above 0 without ``offload="cpu"``.
    """
    from zeroshard.fused_adam import fused_adam_kind
    from zeroshard.loss_scaler import DynamicLossScaler

    if offload not in (None, "cpu"):
        raise ValueError(f"offload={offload!r} must be None or 'cpu'")
    if offload is not None and fused_adam_kind(optimizer) is None:
        raise ValueError(f"offload='cpu' runs torch's fused CPU Adam/AdamW: it needs torch.optim.Adam or AdamW without amsgrad, capturable or differentiable, got {type(optimizer).__name__}")
    if isinstance(gpu_margin_mem_ratio, bool) or not isinstance(gpu_margin_mem_ratio, (int, float)) or not 0.0 <= gpu_margin_mem_ratio <= 1.0:
        raise ValueError(f"gpu_margin_mem_ratio={gpu_margin_mem_ratio!r} must be a number between 0.0 and 1.0")
    if gpu_margin_mem_ratio > 0 and offload is None:
        raise ValueError(f"gpu_margin_mem_ratio={gpu_margin_mem_ratio!r} places offloaded state: it needs offload='cpu' (without offload all state is on the device)")
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm={max_grad_norm!r} must be None or a positive number")
    if not (loss_scale is None or loss_scale == "dynamic" or isinstance(loss_scale, DynamicLossScaler)
            or (isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool) and loss_scale > 0)):
        raise ValueError(f"loss_scale={loss_scale!r} must be None, 'dynamic', a positive number or a DynamicLossScaler")


def check_params(params: list[nn.Parameter], groups: range, device: torch.device | None, first: bool) -> torch.device:
    """Raise on params that cannot be sharded; return the one device they (and ``device``) share.

    Args:
        params: the params of the param groups ``groups`` about to be sharded.
        groups: their indices in ``param_groups`` (for the message).
        device: the device of the params sharded so far, or ``None``.
        first: these are the optimizer's first groups (then some param must be trainable).

    Raises:
        ValueError: no trainable param (first groups only), sparse params, non-floating
            trainable params, or params on several devices.
    """
    trainable = [p for p in params if p.requires_grad]
    if first and not trainable:
        raise ValueError(f"param_groups {list(groups)} hold {len(params)} params, none with requires_grad=True: nothing to optimize")
    bad = [(tuple(p.shape), str(p.layout)) for p in params if p.layout != torch.strided]
    if bad:
        raise ValueError(f"sparse params are not supported (shape, layout): {bad[:5]}")
    bad = [(tuple(p.shape), str(p.dtype)) for p in trainable if not p.dtype.is_floating_point]
    if bad:
        raise ValueError(f"only real floating-point params can be sharded; got (shape, dtype) {bad[:5]}")
    devices = {p.device for p in params} | ({device} if device is not None else set())
    if len(devices) > 1:
        raise ValueError(f"all params must be on one device; got params on {sorted(map(str, devices))}")
    return devices.pop()
