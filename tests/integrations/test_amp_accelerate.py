"""A plain ``Accelerator`` with a GradScaler (fp16 AMP) and ``accelerator.clip_grad_norm_``: a ShardedOptimizer
trains as DDP + AdamW does under the same recipe, and the norm it returns is DDP's unscaled norm.

accelerate runs fp16 AMP on GPUs only (on CPU it keeps no GradScaler), so this gives the
accelerator the GradScaler it would make there. ``accelerator.clip_grad_norm_`` unscales through
``scaler.unscale_(opt)`` (the virtual params' ``VirtualGrad`` s, unscaled in place) and clips the
model's ``ShardedGrad`` s with ``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from models import TinyNet, batch, loss_fn, param_groups, tolerance_ratio
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard

pytest.importorskip("accelerate")

CLIP = 0.5


def accelerate_amp_worker() -> tuple[list[float], list[float], float]:
    from accelerate import Accelerator

    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    ref = DDP(ref_model, find_unused_parameters=True)
    ref_opt = torch.optim.AdamW(param_groups(ref_model), lr=1e-2, foreach=False)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    accelerator = Accelerator(cpu=True)
    # What Accelerator(mixed_precision="fp16") keeps and says on a GPU (its clip_grad_norm_ then unscales first).
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    accelerator.native_amp, before = True, accelerator.state._mixed_precision
    accelerator.state._mixed_precision = "fp16"
    try:
        return _train(accelerator, ref, ref_opt, ref_scaler, model)
    finally:
        accelerator.state._mixed_precision = before  # the state is shared by the worker process's later tests


def _train(accelerator, ref, ref_opt, ref_scaler, model) -> tuple[list[float], list[float], float]:
    opt = accelerator.prepare_optimizer(zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2, foreach=False)))
    ref_norms, norms = [], []
    for step in range(4):
        x, y = batch(dist.get_rank(), step)
        with torch.autocast("cpu", dtype=torch.float16):
            ref_loss, loss = loss_fn(ref, x, y), loss_fn(model, x, y)
        ref_scaler.scale(ref_loss).backward()
        ref_scaler.unscale_(ref_opt)
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.module.parameters(), CLIP).item())
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        accelerator.backward(loss)  # scaler.scale(loss).backward()
        norms.append(accelerator.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()  # AcceleratedOptimizer: scaler.step(opt), scaler.update()
        opt.zero_grad()
    return ref_norms, norms, tolerance_ratio(model, ref.module)


def test_plain_accelerator_clips_by_the_unscaled_norm_under_fp16_like_ddp(pools):
    for ref_norms, norms, ratio in pools[2].run(accelerate_amp_worker):
        assert norms == pytest.approx(ref_norms, rel=1e-6) and min(norms) > CLIP, (norms, ref_norms)
        assert ratio <= 1.0, ratio  # rtol 1e-6
