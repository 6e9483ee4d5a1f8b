"""``master_weights=False``: the wrapped optimizer steps the 16-bit params themselves, as it would unsharded.

With the default fp32 masters a bf16 model trains like mixed precision (fp32 master, grad shard and moments).
``master_weights=False`` hands the wrapped optimizer views of the bf16 params with bf16 gradients, so an optimizer
built for bf16 params (torchao's ``bf16_stochastic_round``, which rounds only when it is handed bf16 params) runs as
designed and no fp32 master is kept. Training equals DDP + the same optimizer on the bf16 model bit for bit, at
stages 1 and 2, with ``torch.optim.AdamW`` (flat 1-D slices) and torchao's ``_AdamW`` (whole params per rank), with
``torch.nn.utils.clip_grad_norm_`` on the params computing DDP's bf16 norm, and the state checkpoints through DCP and
the full format in bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard

STEPS = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64)).to(torch.bfloat16)


def _optimizer(kind: str, model: nn.Module, **options) -> torch.optim.Optimizer:
    if kind == "AdamW":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    import torchao.optim

    return torchao.optim._AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **options)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
        x, y = torch.randn(8, 64, generator=g).bfloat16(), torch.randn(8, 64, generator=g).bfloat16()
        nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)  # active: the norms are about 0.4; bf16 as under DDP
        opt.step()
        opt.zero_grad()


def parity_worker(kind: str, stage: int, directory: str) -> dict:
    """DDP + the optimizer on the bf16 model, and ShardedOptimizer(master_weights=False) checkpointed after 2 steps."""
    reference = _model()
    _train(DDP(reference), _optimizer(kind, reference), range(STEPS))

    model = _model()
    opt = zeroshard.ShardedOptimizer(_optimizer(kind, model), stage=stage, master_weights=False)
    _train(model, opt, range(2))
    dcp.save({"optim": opt}, checkpoint_id=f"{directory}/dcp")
    torch.save(model.state_dict(), f"{directory}/model{dist.get_rank()}.pt")
    usage = opt.memory_usage().by_kind
    virtual = [p for group in opt.param_groups for p in group["params"]]
    state = [v for s in opt.optimizer.state.values() for k, v in s.items() if k != "step"]
    _train(model, opt, range(2, STEPS))
    opt.consolidate_state_dict(to=0)
    full = opt.state_dict() if dist.get_rank() == 0 else None
    return {
        "final": [p.detach().clone() for p in model.parameters()],
        "reference": [p.detach().clone() for p in reference.parameters()],
        "virtual_dtypes": {p.dtype for p in virtual} | {p.grad.dtype for p in virtual if p.grad is not None},
        "state_dtypes": {v.dtype for v in state},
        "master_bytes": usage["master"],
        "grad_shard_dtype": opt._shards[0].grad_shard.dtype,
        "full_dtypes": None if full is None else {v.dtype for s in full["state"].values() for k, v in s.items() if k != "step"},
        "full_masters": None if full is None else len(full["zeroshard"]["master"]),
    }


def resume_worker(kind: str, stage: int, directory: str) -> list[torch.Tensor]:
    """Resume at step 2 from the DCP checkpoint and finish; the final params."""
    model = _model()
    model.load_state_dict(torch.load(f"{directory}/model{dist.get_rank()}.pt"))
    opt = zeroshard.ShardedOptimizer(_optimizer(kind, model), stage=stage, master_weights=False)
    dcp.load({"optim": opt}, checkpoint_id=f"{directory}/dcp")
    _train(model, opt, range(2, STEPS))
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(("kind", "stage"), [("AdamW", 1), ("AdamW", 2), ("_AdamW", 2)])
def test_bf16_params_train_like_ddp_and_resume_bitwise(pools, tmp_path, kind, stage):
    if kind == "_AdamW":
        pytest.importorskip("torchao.optim")
    runs = pools[2].run(parity_worker, kind, stage, str(tmp_path))
    for run in runs:
        assert all(torch.equal(a, b) for a, b in zip(run["final"], run["reference"])), "differs from DDP + the optimizer on bf16 params"
        assert run["virtual_dtypes"] == {torch.bfloat16}, "the wrapped optimizer must see bf16 params and gradients"
        assert run["state_dtypes"] == {torch.bfloat16}
        assert run["master_bytes"] == 0 and run["grad_shard_dtype"] == torch.bfloat16
    assert runs[0]["full_dtypes"] == {torch.bfloat16} and runs[0]["full_masters"] == 0
    resumed = pools[2].run(resume_worker, kind, stage, str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(resumed[0], runs[0]["final"])), "the DCP resume differs"


def stochastic_rounding_worker(master_weights: bool) -> tuple[int, float]:
    """Three steps of 1e-5 on params of 1.0 (bf16 spacing 2**-8 just below 1.0) under torchao's ``bf16_stochastic_round``:
    how many elements moved, and their mean shift. The gradient of ``sum(W x + b)`` for ``x = 1`` is the same positive
    constant every step, so Adam moves every element by ``lr`` each step."""
    import torchao.optim

    model = nn.Linear(256, 256).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    inner = torchao.optim._AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, bf16_stochastic_round=True)
    opt = zeroshard.ShardedOptimizer(inner, stage=2, master_weights=master_weights)
    for _ in range(3):
        model(torch.ones(8, 256, dtype=torch.bfloat16)).sum().backward()
        opt.step()
        opt.zero_grad()
    shift = torch.cat([p.detach().float().flatten() - 1.0 for p in model.parameters()])
    return int((shift != 0).sum()), float(shift.mean())


def test_stochastic_rounding_runs_on_the_bf16_params(pools):
    """With fp32 masters torchao is handed fp32 virtual params and its stochastic rounding never runs: the master moves
    to 1 - 3e-5, which rounds back to 1.0 in the params. Handed the bf16 params themselves, it rounds stochastically:
    an element drops one spacing (2**-8) with probability 1e-5 / 2**-8 per step, so the mean shift is about -3e-5."""
    pytest.importorskip("torchao.optim")
    own = pools[2].run(stochastic_rounding_worker, False)[0]
    masters = pools[2].run(stochastic_rounding_worker, True)[0]
    assert masters == (0, 0.0), "fp32 masters: three 1e-5 steps round back to 1.0 in the bf16 params"
    assert own[0] > 0, "master_weights=False: stochastic rounding moves some elements"
    assert own[1] == pytest.approx(-3e-5, rel=0.25), "the mean shift follows three steps of lr=1e-5"


def test_master_weights_is_checked_before_any_collective():
    model = _model()
    with pytest.raises(TypeError, match="master_weights=1 must be True or False"):
        zeroshard.ShardedOptimizer(torch.optim.AdamW(model.parameters()), master_weights=1)
    with pytest.raises(ValueError, match="master_weights=False with offload='cpu'"):
        zeroshard.ShardedOptimizer(torch.optim.AdamW(model.parameters()), master_weights=False, offload="cpu")


def cross_load_worker(saved_with: bool, directory: str) -> tuple[str, bool, str]:
    """A per-rank state dict saved with ``master_weights=saved_with`` loaded into the other mode (the error), its full format
    loaded there (which converts: moments cast to the new state dtype, masters from the params), and its DCP checkpoint
    loaded there (what happened)."""
    model = _model()
    opt = zeroshard.ShardedOptimizer(_optimizer("AdamW", model), stage=2, master_weights=saved_with)
    _train(model, opt, range(1))
    dcp.save({"optim": opt}, checkpoint_id=directory)
    own = opt.state_dict()
    opt.consolidate_state_dict(to=0)
    full = opt.state_dict() if dist.get_rank() == 0 else None
    full = [full]
    dist.broadcast_object_list(full, src=0)
    opt.close()
    other = zeroshard.ShardedOptimizer(_optimizer("AdamW", model), stage=2, master_weights=not saved_with)
    with pytest.raises(ValueError) as raised:
        other.load_state_dict(own)
    other.load_state_dict(full[0])
    moments = [v for s in other.optimizer.state.values() for k, v in s.items() if k == "exp_avg"]
    converted = bool(moments) and all(m.dtype == (torch.bfloat16 if saved_with else torch.float32) for m in moments)
    try:
        dcp.load({"optim": other}, checkpoint_id=directory)
        from_dcp = "loaded"
    except (Exception, CheckpointException) as error:  # DCP's CheckpointException derives from BaseException
        from_dcp = str(error)
    return str(raised.value), converted, from_dcp


@pytest.mark.parametrize("saved_with", [True, False])
def test_a_state_dict_from_the_other_master_weights_mode_names_it_or_converts(pools, tmp_path, saved_with):
    for message, converted, from_dcp in pools[2].run(cross_load_worker, saved_with, str(tmp_path)):
        assert f"saved with master_weights={saved_with}" in message and f"build the optimizer with master_weights={saved_with}" in message
        assert converted, "the full format loads into the other mode, moments in its state dtype"
        # DCP: fp32 moments load into bf16 ones (cast) and the masters are not asked for; a checkpoint without masters lacks them
        assert from_dcp == "loaded" if saved_with else "Missing key in checkpoint state_dict" in from_dcp and "master" in from_dcp


def own_clip_worker() -> tuple[float, torch.dtype, float]:
    """``opt.clip_grad_norm_`` on bf16 params without masters: its norm (fp32, from the bf16 gradients), and DDP's (bf16)."""
    reference, model = _model(), _model()
    ddp = DDP(reference)
    opt = zeroshard.ShardedOptimizer(_optimizer("AdamW", model), stage=2, master_weights=False)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(8, 64, generator=g).bfloat16(), torch.randn(8, 64, generator=g).bfloat16()
    nn.functional.mse_loss(ddp(x), y).backward()
    nn.functional.mse_loss(model(x), y).backward()
    ours = opt.clip_grad_norm_(0.3)
    return float(ours), ours.dtype, float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.3))


def test_own_clip_computes_the_norm_in_fp32(pools):
    # torch's clip on the params gives DDP's bf16 norm bit for bit (parity test above); the optimizer's own clip sums in fp32
    for ours, dtype, ddps in pools[2].run(own_clip_worker):
        assert dtype == torch.float32 and abs(ours - ddps) <= 2**-8 * ddps
