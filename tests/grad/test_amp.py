"""torch.amp.GradScaler driving a ShardedOptimizer, against DDP + AdamW driven by the same recipe.

The AMP recipe runs unchanged (fp16 autocast, ``scaler.scale(loss).backward()``, optionally
``scaler.unscale_(opt)`` and a clip, ``scaler.step(opt)``, ``scaler.update()``), with an inf loss on
one rank at one step: every rank skips that step, and the GradScaler's scale follows the same path
as the reference's (grows every ``GROWTH_INTERVAL`` clean steps, halves on the skipped one).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist
from models import TinyNet, batch, loss_fn, param_groups, tolerance_ratio
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard

STEPS = 10
INF_STEP = 6
GROWTH_INTERVAL = 2
CLIP = 0.5


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _amp_step(model, opt, scaler: torch.amp.GradScaler, step: int, clip) -> None:
    """One step of the AMP recipe; ``clip(model, opt)`` runs between ``unscale_`` and ``step`` (None: no unscale_)."""
    x, y = batch(dist.get_rank(), step)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_fn(model, x, y)
    if step == INF_STEP and dist.get_rank() == 1:
        loss = loss * float("inf")  # an overflow on one rank only
    scaler.scale(loss).backward()
    if clip is not None:
        scaler.unscale_(opt)
        clip(model, opt)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def amp_worker(stage: int, clipped: bool) -> tuple[float, list[float], list[float], list[bool]]:
    """Worst tolerance ratio over all steps; the reference's and zeroshard's scale after each step; step_was_skipped per step."""
    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    ref = DDP(ref_model, find_unused_parameters=True)
    ref_opt = torch.optim.AdamW(param_groups(ref_model), lr=1e-2, foreach=False)
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2, foreach=False), stage=stage, bucket_size_mb=200 * 4 / 2**20)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=GROWTH_INTERVAL) for _ in range(2)]
    ref_clip = (lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)) if clipped else None
    clip = (lambda m, o: o.clip_grad_norm_(CLIP)) if clipped else None
    worst, ref_scales, scales, skipped = 0.0, [], [], []
    logged = _Records()
    logging.getLogger("zeroshard").addHandler(logged)
    for step in range(STEPS):
        _amp_step(ref, ref_opt, scalers[0], step, ref_clip)
        _amp_step(model, opt, scalers[1], step, clip)
        worst = max(worst, tolerance_ratio(model, ref_model))
        ref_scales.append(scalers[0].get_scale())
        scales.append(scalers[1].get_scale())
        skipped.append(opt.step_was_skipped)
    logging.getLogger("zeroshard").removeHandler(logged)
    assert not any("no loss scale active" in m for m in logged.messages), logged.messages  # the GradScaler's skip: no warning
    return worst, ref_scales, scales, skipped


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("clipped", [False, True], ids=["step", "unscale-clip-step"])
def test_grad_scaler_drives_the_optimizer_like_ddp(pools, stage, clipped):
    for worst, ref_scales, scales, skipped in pools[2].run(amp_worker, stage, clipped):
        assert skipped == [s == INF_STEP for s in range(STEPS)], skipped
        assert scales == ref_scales, (scales, ref_scales)
        assert max(ref_scales) > 2.0**10 and ref_scales[INF_STEP] == ref_scales[INF_STEP - 1] / 2, ref_scales  # grew; backed off at the skip
        assert worst <= 1.0, f"params off DDP + AdamW + GradScaler by {worst:.3g}x the tolerance (rtol 1e-6)"


def double_scaling_worker() -> str:
    model = TinyNet().half()  # fp16 params: ShardedOptimizer's own dynamic loss scale is on
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    scaler = torch.amp.GradScaler("cpu")
    x, y = batch(dist.get_rank(), 0)
    scaler.scale(loss_fn(model, x, y)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"a torch.amp.GradScaler and loss_scale=65536.0 both scale") as error:
        scaler.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return str(error.value)


def test_grad_scaler_with_an_active_loss_scale_raises_before_anything(pools):
    pools[2].run(double_scaling_worker)
