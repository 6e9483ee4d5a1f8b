"""Loss scaling, overflow skipping, clipping and fp16 end to end, on gloo ranks."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.distributed as dist
from models import TinyNet, batch, loss_fn, param_groups, relative_error, tolerance_ratio
from test_parity import _train_pair
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard


def test_loss_scaler_follows_the_scripted_trajectory():
    scaler = zeroshard.DynamicLossScaler(initial_scale=8.0, growth_interval=2, hysteresis=2, min_scale=2.0, max_scale=16.0)
    pattern = [False, False, True, True, True, True, False, False, False, False, False, False, True]
    scales = []
    for found_inf in pattern:
        scaler.update(found_inf)
        scales.append(scaler.scale)
    # grow after 2 finite steps; the first overflow is absorbed by hysteresis, the next ones back
    # off down to min_scale; growth stops at max_scale; the last overflow is absorbed again.
    assert scales == [8.0, 16.0, 16.0, 8.0, 4.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0, 16.0, 16.0]
    restored = zeroshard.DynamicLossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
    with pytest.raises(ValueError, match=r"backoff_factor=1.5 is out of range"):
        zeroshard.DynamicLossScaler(backoff_factor=1.5)


def _snapshot(model, opt) -> list[torch.Tensor]:
    state = [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return [p.detach().clone() for p in model.parameters()] + state


def overflow_on_one_rank_worker(stage: int) -> tuple[bool, bool, float, float]:
    """An inf in rank 1's gradients only: every rank skips, nothing changes, the scale backs off."""
    torch.manual_seed(0)
    model = TinyNet().half()
    scaler = zeroshard.DynamicLossScaler(initial_scale=1024.0, hysteresis=1)
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), stage=stage, loss_scale=scaler)
    opt.backward(loss_fn(model, *batch(dist.get_rank(), 0)))
    opt.step()
    model.zero_grad()
    before = _snapshot(model, opt)
    loss = loss_fn(model, *batch(dist.get_rank(), 1))
    if dist.get_rank() == 1:
        loss = loss * float("inf")
    opt.backward(loss)
    opt.step()
    after = _snapshot(model, opt)
    unchanged = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    return opt.step_was_skipped, unchanged, opt.loss_scale, float(opt.grad_norm)


@pytest.mark.parametrize("stage", [1, 2])
def test_inf_on_one_rank_skips_the_step_everywhere(pools, stage):
    for skipped, unchanged, scale, norm in pools[2].run(overflow_on_one_rank_worker, stage):
        assert skipped and unchanged and scale == 512.0 and not math.isfinite(norm)


def nan_without_loss_scale_worker() -> tuple[bool, bool, list[tuple[int, str]]]:
    """fp32, no loss scale, a NaN in rank 1's gradients: every rank skips; what rank 0 logged (level, message)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("zeroshard")
    logger.addHandler(handler)
    try:
        torch.manual_seed(0)
        model = TinyNet()
        opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), stage=2)
        before = _snapshot(model, opt)
        loss = loss_fn(model, *batch(dist.get_rank(), 0))
        (loss * float("nan") if dist.get_rank() == 1 else loss).backward()
        opt.step()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, _snapshot(model, opt)))
    finally:
        logger.removeHandler(handler)
    return opt.step_was_skipped, unchanged, [(r.levelno, r.getMessage()) for r in records if "skipped" in r.getMessage()]


def test_nan_gradients_without_a_loss_scale_skip_and_warn(pools):
    # DDP + AdamW would write the NaN into the params; zeroshard skips, and says so at WARNING (with a loss scale a skip is routine: INFO)
    runs = pools[2].run(nan_without_loss_scale_worker)
    assert all(skipped and unchanged for skipped, unchanged, _ in runs)
    assert [level for level, _ in runs[0][2]] == [logging.WARNING] and "no loss scale active" in runs[0][2][0][1]
    assert runs[1][2] == []  # rank 0 logs


def norm_worker(norm_type: float) -> tuple[float, float]:
    torch.manual_seed(0)
    model, ref_model = TinyNet(), TinyNet()
    ref_model.load_state_dict(model.state_dict())
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), bucket_size_mb=100 * 4 / 2**20)
    ddp = DDP(ref_model)
    x, y = batch(dist.get_rank(), 0)
    loss_fn(model, x, y).backward()
    loss_fn(ddp, x, y).backward()
    # zeroshard.clip_grad_norm_ takes one optimizer, as torch's takes one tensor (a TypeError, "not iterable", before)
    return float(zeroshard.clip_grad_norm_(opt, 0.1, norm_type)), float(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.1, norm_type))


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_global_norm_equals_torch_clip_grad_norm(pools, norm_type):
    for ours, torch_norm in pools[2].run(norm_worker, norm_type):
        assert ours == pytest.approx(torch_norm, rel=1e-6)


def clipped_parity_worker(stage: int, clip_api: bool, optimizer_name: str) -> float:
    optimizer_class = getattr(torch.optim, optimizer_name)
    worst = 0.0
    for ref_model, model, _ in _train_pair(stage, "backward", True, max_grad_norm=0.5, clip_api=clip_api, optimizer_class=optimizer_class):
        worst = max(worst, tolerance_ratio(model, ref_model))
    return worst


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage, clip_api, optimizer_name", [(1, False, "AdamW"), (2, False, "AdamW"), (2, True, "AdamW"), (2, False, "SGD")])
def test_training_with_clipping_matches_ddp_clip_adamw(pools, world_size, stage, clip_api, optimizer_name):
    for worst in pools[world_size].run(clipped_parity_worker, stage, clip_api, optimizer_name):
        assert worst <= 1.0, f"{worst:.3g}x the tolerance (rtol 1e-6, atol 1e-7)"


def fp16_worker(stage: int) -> tuple[float, float, float, float | None, int]:
    """fp16 params with the default dynamic loss scale, against fp32, fp16 and bf16 DDP + AdamW."""
    fp32 = list(_train_pair(stage, "none", True, torch.float32))[-1][0]
    ddp_fp16, sharded, opt = list(_train_pair(stage, "none", True, torch.float16))[-1]
    ddp_bf16 = list(_train_pair(stage, "none", True, torch.bfloat16))[-1][0]
    return relative_error(sharded, fp32), relative_error(ddp_fp16, fp32), relative_error(ddp_bf16, fp32), opt.loss_scale, opt._skipped_steps


@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_trains_with_dynamic_scaling(pools, stage):
    sharded_err, fp16_err, bf16_err, scale, skipped = pools[2].run(fp16_worker, stage)[0]
    assert scale is not None and skipped == 0  # the loss scale was on, and no step overflowed here
    # Plain AdamW on fp16 params turns to NaN here (eps=1e-8 underflows to 0 in fp16, then 0/0):
    # where torch's own fp16 path has no finite error, bound by DDP's bf16 error instead.
    baseline = fp16_err if math.isfinite(fp16_err) else bf16_err
    assert math.isfinite(sharded_err) and sharded_err <= 2 * baseline, (sharded_err, fp16_err, bf16_err)


def scaler_checkpoint_worker() -> tuple[float, float, float]:
    torch.manual_seed(0)
    model = TinyNet().half()
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2),
                                     loss_scale=zeroshard.DynamicLossScaler(initial_scale=64.0, growth_interval=1))
    for step in range(3):
        opt.backward(loss_fn(model, *batch(dist.get_rank(), step)))
        opt.step()
    sharded = copy.deepcopy(opt.state_dict())
    opt.consolidate_state_dict(to=0)
    full = [opt.state_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(full, src=0)
    restored = []
    for state in (sharded, full[0]):
        fresh = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(TinyNet().half()), lr=1e-2))
        fresh.load_state_dict(state)
        restored.append(fresh.loss_scale)
    return opt.loss_scale, restored[0], restored[1]


def test_loss_scale_survives_checkpoints(pools):
    for scale, from_sharded, from_full in pools[2].run(scaler_checkpoint_worker):
        assert scale == 512.0 and from_sharded == scale and from_full == scale


def configured_implementation_worker(flag: str) -> bool:
    """On CPU the flat shard is stepped by the torch implementation the user configured."""
    torch.manual_seed(0)
    model, ref_model = TinyNet(), TinyNet()
    ref_model.load_state_dict(model.state_dict())
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2, **{flag: True}))
    ref = torch.optim.AdamW(param_groups(ref_model), lr=1e-2, **{flag: True})
    for step in range(5):
        for m, o in ((model, opt), (ref_model, ref)):
            loss_fn(m, *batch(0, step)).backward()
            o.step()
            m.zero_grad()
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


@pytest.mark.parametrize("flag", ["foreach", "fused"])
def test_cpu_step_uses_the_configured_torch_implementation(pools, flag):
    assert pools[1].run(configured_implementation_worker, flag) == [True]


@pytest.mark.parametrize("adamw, flags", [(True, {}), (True, {"foreach": True}), (False, {}), (True, {"fused": True})])
def test_device_adam_equals_torch_per_param(adamw, flags):
    """The device update's math, called as a function: two runs at different step counts, with a
    gradient multiplier and a 16-bit param_out, against torch.optim's own Adam/AdamW stepping each
    run as a param (bitwise: the same implementation, the gradient multiplied the same way)."""
    from zeroshard.step.fused_adam import Run, device_adam

    g = torch.Generator().manual_seed(0)
    group = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1, "maximize": False, **flags}
    multiplier = 0.25
    runs, references = [], []
    for numel, step in ((7, 1), (13, 4)):
        param, grad = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
        exp_avg, exp_avg_sq = torch.randn(numel, generator=g) * 0.1, torch.rand(numel, generator=g) * 0.01
        reference = torch.nn.Parameter(param.clone())
        reference.grad = grad * multiplier
        optimizer = (torch.optim.AdamW if adamw else torch.optim.Adam)([reference], **group)
        optimizer.state[reference] = {"step": torch.tensor(float(step - 1)), "exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone()}
        optimizer.step()
        references.append((reference.detach(), optimizer.state[reference]))
        runs.append(Run(param, grad, exp_avg, exp_avg_sq, torch.empty(numel, dtype=torch.bfloat16), step))
    device_adam(runs, group, multiplier, adamw, torch.device("cpu"))
    for run, (param, state) in zip(runs, references):
        assert torch.equal(run.param, param) and torch.equal(run.exp_avg, state["exp_avg"]) and torch.equal(run.exp_avg_sq, state["exp_avg_sq"])
        assert torch.equal(run.param_out, param.to(torch.bfloat16))


def plain_backward_worker(stage: int) -> tuple[bool, float | None, float | None]:
    """fp16 params, so a dynamic loss scale is on, but a plain ``loss.backward()`` (no ``opt.backward``), as under torch.optim:
    (params and pre-clip norms equal, bitwise, to the same training with ``loss_scale=1.0``, no scaling; the scale before; after)."""
    runs, norms = [], []
    for loss_scale in ("dynamic", 1.0):
        torch.manual_seed(0)
        model = TinyNet().half()
        opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), stage=stage, loss_scale=loss_scale, max_grad_norm=1.0)
        before = opt.loss_scale
        for step in range(4):
            (loss_fn(model, *batch(dist.get_rank(), step)) * 1e-3).backward()  # small gradients: Adam's eps tells the scales apart
            opt.step()
            norms.append(float(opt.grad_norm))
            opt.zero_grad()
        runs.append((model, before, opt.loss_scale))
    (scaled_model, before, after), (plain_model, _, _) = runs
    same = norms[:4] == norms[4:] and all(torch.equal(a, b) for a, b in zip(scaled_model.parameters(), plain_model.parameters()))
    return same, before, after


@pytest.mark.parametrize("stage", [1, 2])
def test_a_plain_backward_under_an_active_loss_scale_is_taken_as_unscaled(pools, stage):
    # The step divided the gradients by a scale the loss never got (65536x too small: a silent wrong update, no error).
    for same, before, after in pools[2].run(plain_backward_worker, stage):
        assert same and before == after == 65536.0, (same, before, after)
