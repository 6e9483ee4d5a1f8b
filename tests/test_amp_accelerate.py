"""``ShardedAccelerator.clip_grad_norm_`` under fp16 AMP: the norm it returns is unscaled, as ``Accelerator``'s.

accelerate runs fp16 AMP on GPUs only (on CPU it keeps no GradScaler), so this gives the
accelerator the GradScaler it would make there, and checks the norm and the params against the
plain AMP recipe (``scaler.unscale_(opt)``, ``opt.clip_grad_norm_``), which tests/test_amp.py
checks against DDP + AdamW.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from models import TinyNet, batch, loss_fn, param_groups

import zeroshard

pytest.importorskip("accelerate")

CLIP = 0.5


def accelerate_amp_worker() -> tuple[list[float], list[float], bool]:
    from zeroshard.integrations.accelerate import ShardedAccelerator

    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    ref_opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(ref_model), lr=1e-2, foreach=False))
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    accelerator = ShardedAccelerator(cpu=True)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # what Accelerator(mixed_precision="fp16") keeps on a GPU
    opt = accelerator.prepare_optimizer(zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2, foreach=False)))
    ref_norms, norms = [], []
    for step in range(4):
        x, y = batch(dist.get_rank(), step)
        with torch.autocast("cpu", dtype=torch.float16):
            ref_loss, loss = loss_fn(ref_model, x, y), loss_fn(model, x, y)
        ref_scaler.scale(ref_loss).backward()
        ref_scaler.unscale_(ref_opt)
        ref_norms.append(ref_opt.clip_grad_norm_(CLIP).item())
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        accelerator.backward(loss)  # scaler.scale(loss).backward()
        norms.append(accelerator.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()  # AcceleratedOptimizer: scaler.step(opt), scaler.update()
        opt.zero_grad()
    return ref_norms, norms, all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


def test_sharded_accelerator_clips_by_the_unscaled_norm_under_fp16(pools):
    for ref_norms, norms, same in pools[2].run(accelerate_amp_worker):
        assert norms == ref_norms and min(norms) > CLIP, (norms, ref_norms)
        assert same
