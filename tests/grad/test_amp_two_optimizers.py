"""One torch.amp.GradScaler driving two ShardedOptimizers of one model, against DDP + two torch optimizers.

AdamW on the matrices and Adam on the vectors (disjoint params, both on the default process
group), fp16 autocast, torch's recipe for one GradScaler and several optimizers:
``scaler.scale(loss).backward()``, optionally ``scaler.unscale_`` of each and one global clip
(``torch.nn.utils.clip_grad_norm_(model.parameters())`` in the reference,
``zeroshard.clip_grad_norm_(opts)`` here), ``scaler.step`` of each, one ``scaler.update()``. An inf
loss on one rank at one step: every rank skips that step in both optimizers, and the scale backs
off once (as in test_amp.py, it grows every ``GROWTH_INTERVAL`` clean steps). An inf in the
matrices' gradients alone on one rank at another step: AdamW skips on every rank, Adam steps
(torch's GradScaler decides per optimizer), and with the global clip its coefficient is 0 (the
global norm is inf), so Adam takes a step on zero gradients, as in the reference.

Each step's params are compared, and the reference then continues from zeroshard's params (its
optimizer state is left alone): the clipped run folds unscale and clip into one multiply and so
ends a step some fp32 ulps off the reference; without the copy, one fp16 autocast cast of a
param that rounds the other way at a later step changes every gradient upstream of it by far more
than that (without the copy: one element of branch.weight at step 9, and the layers before it 15x
the rtol-1e-6 tolerance off). The unclipped run is bitwise equal, so there the copy changes nothing.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from models import TinyNet, batch, loss_fn, tolerance_ratio
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard

STEPS = 10
INF_STEP = 6
MATRICES_INF_STEP = 3
GROWTH_INTERVAL = 2
CLIP = 0.5


def _optimizers(model: torch.nn.Module, fused: bool) -> list[torch.optim.Optimizer]:
    """AdamW with weight decay on the matrices, Adam on the vectors (the frozen one included)."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return [torch.optim.AdamW(matrices, lr=1e-2, weight_decay=0.1, foreach=False, fused=fused),
            torch.optim.Adam(vectors, lr=1e-2, foreach=False, fused=fused)]


def _amp_step(model, core: TinyNet, opts, scaler: torch.amp.GradScaler, step: int, clip) -> float:
    """One step of torch's recipe for one GradScaler and several optimizers; ``clip(model, opts)``
    runs after every ``unscale_`` (None: no unscale_) and returns the global pre-clip norm (nan without)."""
    x, y = batch(dist.get_rank(), step)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_fn(model, x, y)
    if step == INF_STEP and dist.get_rank() == 1:
        loss = loss * float("inf")  # an overflow on one rank only
    if step == MATRICES_INF_STEP and dist.get_rank() == 1:
        loss = loss + float("inf") * core.fc1.weight.square().sum()  # inf in fc1.weight's gradient only (±inf, no NaN)
    scaler.scale(loss).backward()
    norm = math.nan
    if clip is not None:
        for opt in opts:
            scaler.unscale_(opt)
        norm = float(clip(model, opts))
    for opt in opts:
        scaler.step(opt)
    scaler.update()
    for opt in opts:
        opt.zero_grad()
    return norm


def two_optimizers_worker(stage: int, clipped: bool, offload: str | None) -> tuple[float, list[float], list[float], list[list[bool]], list[float], list[float]]:
    """Worst tolerance ratio over all steps; the reference's and zeroshard's scale after each step;
    step_was_skipped of both ShardedOptimizers per step; the reference's and zeroshard's global norm per step."""
    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    ref = DDP(ref_model, find_unused_parameters=True)
    ref_opts = _optimizers(ref_model, fused=offload is not None)  # the offloaded step runs torch's fused CPU math
    opts = [zeroshard.ShardedOptimizer(o, stage=stage, bucket_size_mb=200 * 4 / 2**20, offload=offload) for o in _optimizers(model, offload is not None)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=GROWTH_INTERVAL) for _ in range(2)]
    ref_clip = (lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)) if clipped else None
    clip = (lambda m, o: zeroshard.clip_grad_norm_(o, CLIP)) if clipped else None
    worst, ref_scales, scales, skipped, ref_norms, norms = 0.0, [], [], [], [], []
    for step in range(STEPS):
        ref_norms.append(_amp_step(ref, ref_model, ref_opts, scalers[0], step, ref_clip))
        norms.append(_amp_step(model, model, opts, scalers[1], step, clip))
        assert all(p.isfinite().all() for p in model.parameters())  # tolerance_ratio would not see a NaN
        worst = max(worst, tolerance_ratio(model, ref_model))
        with torch.no_grad():  # the next step starts from the same params (see the module docstring)
            for ref_param, param in zip(ref_model.parameters(), model.parameters()):
                ref_param.copy_(param)
        ref_scales.append(scalers[0].get_scale())
        scales.append(scalers[1].get_scale())
        skipped.append([opt.step_was_skipped for opt in opts])
    return worst, ref_scales, scales, skipped, ref_norms, norms


@pytest.mark.parametrize(("stage", "clipped", "offload"), [(1, False, None), (2, False, None), (1, True, None), (2, True, None), (2, True, "cpu")],
                         ids=["step-1", "step-2", "unscale-clip-step-1", "unscale-clip-step-2", "unscale-clip-step-2-offload"])
def test_one_grad_scaler_drives_two_optimizers_like_ddp(pools, stage, clipped, offload):
    for worst, ref_scales, scales, skipped, ref_norms, norms in pools[2].run(two_optimizers_worker, stage, clipped, offload):
        assert skipped == [[s in (INF_STEP, MATRICES_INF_STEP), s == INF_STEP] for s in range(STEPS)], skipped
        assert scales == ref_scales, (scales, ref_scales)
        assert max(ref_scales) > 2.0**10, ref_scales  # grew
        assert all(ref_scales[s] == ref_scales[s - 1] / 2 for s in (INF_STEP, MATRICES_INF_STEP)), ref_scales  # backed off once each
        assert worst <= 1.0, f"params off DDP + AdamW/Adam + GradScaler by {worst:.3g}x the tolerance (rtol 1e-6)"
        if not clipped:
            assert worst == 0.0, worst  # bitwise: the GradScaler's scales are powers of 2, and 2 ranks sum exactly
        else:
            overflows = (INF_STEP, MATRICES_INF_STEP)
            assert all(math.isclose(n, r, rel_tol=1e-6) for s, (n, r) in enumerate(zip(norms, ref_norms)) if s not in overflows), (norms, ref_norms)
            assert all(not math.isfinite(norms[s]) and not math.isfinite(ref_norms[s]) for s in overflows), (norms, ref_norms)
