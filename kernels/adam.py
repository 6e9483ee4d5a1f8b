"""Fused Adam/AdamW step over a flat shard: one read and one write of every buffer.

Replaces the chain a torch loop (or DeepSpeed) runs — unscale, inf check, clip, Adam, cast to the
16-bit param — each a full pass over the state, with one pass: the gradient is multiplied by a
device scalar ``grad_scale`` (1/loss-scale × clip coefficient), the step is a no-op when the device
scalar ``found_inf`` is set, and the updated fp32 param is cast into ``param_out`` in the same pass.
Same math as ``torch.optim.Adam``/``AdamW`` (Kingma & Ba, "Adam", ICLR 2015, Algorithm 1;
Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019, Algorithm 2).

Bytes per element moved (for the benchmark's GB/s): read param, exp_avg, exp_avg_sq (4 each) and
grad (2 or 4); write param, exp_avg, exp_avg_sq (4 each) and param_out (2, if given).
"""

from __future__ import annotations

import torch
from torch import Tensor

from zeroshard.kernels._backend import HAS_TRITON, on_device, use_triton
from zeroshard.kernels.reference import adamw_reference_

BLOCK_SIZE = 1024

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _fused_adamw_kernel(
        param_ptr,  # *fp32 [n_elements]: master weights, updated in place
        grad_ptr,  # *fp32|bf16|fp16 [n_elements]: gradient (scaled by the loss scale)
        exp_avg_ptr,  # *fp32 [n_elements]: first moment, updated in place
        exp_avg_sq_ptr,  # *fp32 [n_elements]: second moment, updated in place
        param_out_ptr,  # *bf16|fp16 [n_elements]: receives the cast param (if HAS_PARAM_OUT)
        grad_scale_ptr,  # *fp32 [1]: multiplied into the gradient (if HAS_GRAD_SCALE)
        found_inf_ptr,  # *fp32 [1]: non-zero turns the call into a no-op (if HAS_FOUND_INF)
        n_elements,  # elements in every buffer
        one_minus_beta1,  # 1 - beta1, from the host in float64 (as torch passes it to lerp_)
        beta2,  # second-moment decay
        one_minus_beta2,  # 1 - beta2, from the host in float64 (as torch passes it to addcmul_)
        eps,  # denominator epsilon
        weight_decay,  # L2 coefficient (Adam)
        decay_factor,  # 1 - lr * weight_decay, from the host in float64 (AdamW: as torch passes it to mul_)
        step_size,  # lr / (1 - beta1**step)
        bias_correction2_sqrt,  # sqrt(1 - beta2**step)
        HAS_GRAD_SCALE: tl.constexpr,
        HAS_FOUND_INF: tl.constexpr,
        HAS_PARAM_OUT: tl.constexpr,
        MAXIMIZE: tl.constexpr,
        ADAMW: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,  # elements per program
    ):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)  # int64: no overflow past 2**31 elements
        limit = n_elements
        if HAS_FOUND_INF:  # an overflow masks off every load and store: a no-op
            limit = tl.where(tl.load(found_inf_ptr) == 0, n_elements, 0)
        mask = offsets < limit
        p = tl.load(param_ptr + offsets, mask=mask)
        g = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
        m = tl.load(exp_avg_ptr + offsets, mask=mask)
        v = tl.load(exp_avg_sq_ptr + offsets, mask=mask)
        if HAS_GRAD_SCALE:
            g = g * tl.load(grad_scale_ptr)
        if MAXIMIZE:
            g = -g
        if ADAMW:
            p = p * decay_factor
        else:
            g = g + weight_decay * p
        m = m + one_minus_beta1 * (g - m)
        v = v * beta2 + one_minus_beta2 * g * g
        # Correctly rounded sqrt and division, as torch's kernels compute them (tl.sqrt and "/" are approximate on GPU)
        denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
        p = p - step_size * tl.div_rn(m, denom)
        tl.store(param_ptr + offsets, p, mask=mask)
        tl.store(exp_avg_ptr + offsets, m, mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, v, mask=mask)
        if HAS_PARAM_OUT:
            tl.store(param_out_ptr + offsets, p.to(param_out_ptr.dtype.element_ty), mask=mask)


def _check_scalar(name: str, value: Tensor | None, like: Tensor) -> None:
    if value is None:
        return
    if value.numel() != 1 or value.dtype != torch.float32 or value.device != like.device:
        raise ValueError(
            f"fused_adamw_: {name} must be a 1-element fp32 tensor on {like.device}; got shape {tuple(value.shape)}, {value.dtype}, {value.device}"
        )


def fused_adamw_(
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
    backend: str = "auto",
) -> None:
    """One Adam/AdamW step over a flat shard, in place, in one pass.

    Args:
        param: 1-D fp32 master weights, updated in place.
        grad: 1-D fp32, bf16 or fp16, same length; read only.
        exp_avg, exp_avg_sq: 1-D fp32 moments, same length, updated in place.
        lr, beta1, beta2, eps, weight_decay: as in ``torch.optim.AdamW``.
        step: the step number after this update (1 for the first), as ``state["step"]`` after
            ``torch.optim`` increments it; bias corrections are computed from it on the host.
        grad_scale: 1-element fp32 device tensor multiplied into the gradient first
            (1/loss-scale × clip coefficient), or ``None``.
        found_inf: 1-element fp32 device tensor; non-zero makes the call a no-op (every buffer
            untouched), or ``None``.
        param_out: 1-D bf16/fp16 tensor of the same length receiving the updated param cast to
            its dtype in the same pass, or ``None``.
        maximize: ascend instead of descend, as in ``torch.optim``.
        adamw: decoupled weight decay (AdamW); ``False`` gives Adam's L2 penalty.
        backend: ``"auto"`` (Triton for CUDA tensors, the torch reference for CPU ones),
            ``"triton"`` (CPU tensors need ``TRITON_INTERPRET=1``) or ``"torch"``.

    The Triton kernel never synchronizes with the host; the torch reference reads ``found_inf``.

    Raises:
        ValueError: tensors that are not 1-D, contiguous, of equal length, on one device, or of
            the dtypes above; ``step`` below 1; an unknown ``backend``.
        RuntimeError: ``backend="triton"`` without Triton, or on CPU without ``TRITON_INTERPRET=1``.
    """
    buffers = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if param_out is not None:
        buffers["param_out"] = param_out
    for name, t in buffers.items():
        if t.dim() != 1 or not t.is_contiguous() or t.numel() != param.numel() or t.device != param.device:
            raise ValueError(f"fused_adamw_: {name} must be 1-D, contiguous, with {param.numel()} elements on {param.device}; got shape "
                             f"{tuple(t.shape)} on {t.device}")
    for name in ("param", "exp_avg", "exp_avg_sq"):
        if buffers[name].dtype != torch.float32:
            raise ValueError(f"fused_adamw_: {name} must be fp32, got {buffers[name].dtype}")
    if grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"fused_adamw_: grad must be fp32, bf16 or fp16, got {grad.dtype}")
    if param_out is not None and param_out.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fused_adamw_: param_out must be bf16 or fp16, got {param_out.dtype}")
    if step < 1:
        raise ValueError(f"fused_adamw_: step={step} must be >= 1 (the step number after this update)")
    _check_scalar("grad_scale", grad_scale, param)
    _check_scalar("found_inf", found_inf, param)
    kwargs = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step, grad_scale=grad_scale,
                  found_inf=found_inf, param_out=param_out, maximize=maximize, adamw=adamw)
    if not use_triton(backend, param, "fused_adamw_"):
        adamw_reference_(param, grad, exp_avg, exp_avg_sq, **kwargs)
        return
    n = param.numel()
    if n == 0:
        return
    with on_device(param):
        _fused_adamw_kernel[(triton.cdiv(n, BLOCK_SIZE),)](
            param, grad, exp_avg, exp_avg_sq,
            param if param_out is None else param_out,
            param if grad_scale is None else grad_scale,
            param if found_inf is None else found_inf,
            n, 1 - beta1, beta2, 1 - beta2, eps, weight_decay, 1 - lr * weight_decay, lr / (1 - beta1 ** float(step)),
            (1 - beta2 ** float(step)) ** 0.5,
            HAS_GRAD_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None, HAS_PARAM_OUT=param_out is not None,
            MAXIMIZE=maximize, ADAMW=adamw, BLOCK_SIZE=BLOCK_SIZE,
        )
