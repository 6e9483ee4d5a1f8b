"""``python -m zeroshard.convert``: a DCP checkpoint saved at 2 ranks into one file, without a process group.

References: the ``ShardedOptimizer``'s own consolidated state (``consolidate_state_dict``), and a
``ShardedOptimizer`` at world size 1 resumed from the same checkpoint with ``dcp.load``, which is
bitwise equal to the unsharded ``torch.optim.AdamW`` it wraps.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from models import TinyNet, batch, loss_fn, param_groups

import zeroshard
from zeroshard.convert import main


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 4))


def _train(model, opt, schedule, steps: range, rank: int) -> None:
    for step in steps:
        loss_fn(model, *batch(rank, step)).backward()
        opt.step()
        schedule.step()
        opt.zero_grad()


def save_worker(directory: str) -> dict | None:
    """As examples/train_gpt.py saves: model, optimizer, LR schedule and step in one DCP checkpoint."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), stage=2, bucket_size_mb=0.001)
    schedule = _schedule(opt)
    _train(model, opt, schedule, range(3), dist.get_rank())
    dcp.save({"model": model.state_dict(), "optim": opt, "schedule": schedule.state_dict(), "step": 3}, checkpoint_id=directory)
    opt.consolidate_state_dict(to=0)
    return opt.state_dict() if dist.get_rank() == 0 else None


def continue_worker(directory: str, converted_file: str) -> bool:
    """Plain AdamW from the converted file against a ShardedOptimizer at world size 1 from the checkpoint, 3 more steps."""
    converted = torch.load(converted_file, weights_only=False)
    plain_model = TinyNet()
    plain_model.load_state_dict(converted["model"])
    plain = torch.optim.AdamW(param_groups(plain_model), lr=1e-2)
    plain_schedule = _schedule(plain)  # before the load, as for the sharded one: the checkpoint's lr wins
    plain.load_state_dict(converted["optim"])
    plain_schedule.load_state_dict(converted["schedule"])

    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), stage=2, bucket_size_mb=0.001)
    schedule = _schedule(opt)
    state = {"model": model.state_dict(), "optim": opt, "schedule": schedule.state_dict(), "step": 0}
    dcp.load(state, checkpoint_id=directory)
    model.load_state_dict(state["model"])
    schedule.load_state_dict(state["schedule"])
    assert converted["step"] == state["step"] == 3

    for rank in (0, 1):  # both of the saving ranks' batches, one after the other
        _train(plain_model, plain, plain_schedule, range(3, 6), rank)
        _train(model, opt, schedule, range(3, 6), rank)
    return all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), model.parameters()))


def _run_converter(*args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "zeroshard.convert", *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def saved(pools, tmp_path_factory) -> tuple[str, dict]:
    """A DCP checkpoint saved at 2 ranks, and the optimizer's consolidated state then."""
    directory = str(tmp_path_factory.mktemp("convert") / "ckpt")
    return directory, pools[2].run(save_worker, directory)[0]


def test_converted_checkpoint_continues_bitwise_in_plain_adamw(pools, saved, tmp_path):
    (directory, consolidated), converted_file = saved, str(tmp_path / "full.pt")
    _run_converter(directory, converted_file)

    converted = torch.load(converted_file, weights_only=False)
    optim = converted["optim"]
    assert optim["param_groups"] == consolidated["param_groups"]
    assert optim["state"].keys() == consolidated["state"].keys()
    assert 4 not in optim["state"]  # the frozen param: never stepped, no state, as in torch.optim
    for index, expected in consolidated["state"].items():
        assert optim["state"][index].keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(optim["state"][index][key], value), (index, key)
    assert all(pools[1].run(continue_worker, directory, converted_file))


def test_safetensors_output_holds_the_model(saved, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    directory = saved[0]
    _run_converter(directory, str(tmp_path / "model.safetensors"))
    weights = safetensors.load_file(str(tmp_path / "model.safetensors"))
    dcp_to_torch_save(directory, tmp_path / "all.pt")  # torch's own converter: the reference for the model entry
    expected = torch.load(tmp_path / "all.pt", weights_only=False)["model"]
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], v) for k, v in expected.items())


def test_errors_name_the_file(tmp_path, capsys):
    assert main([str(tmp_path / "missing"), str(tmp_path / "out.pt")]) == 1
    assert f"{tmp_path / 'missing'}: the checkpoint directory does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), str(tmp_path / "out.pt")]) == 1
    assert f"{tmp_path / 'empty' / '.metadata'} is missing" in capsys.readouterr().err
    assert main([str(tmp_path / "empty"), str(tmp_path / "no" / "out.pt")]) == 1  # a raw RuntimeError from torch.save before
    assert f"{tmp_path / 'no'}: the directory of {tmp_path / 'no' / 'out.pt'} does not exist" in capsys.readouterr().err
    # No process group; a config that holds a "zeroshard" dict is not an optimizer.
    dcp.save({"model": {"w": torch.ones(2)}, "config": {"zeroshard": {"stage": 2}}}, checkpoint_id=tmp_path / "model_only")
    assert main([str(tmp_path / "model_only"), str(tmp_path / "out.pt")]) == 1
    assert "holds no ShardedOptimizer's state (it has ['config', 'model'])" in capsys.readouterr().err
    assert main([str(tmp_path / "model_only"), str(tmp_path / "out.pt"), "--optim-key", "opt"]) == 1
    assert "has no 'opt' entry (it has ['config', 'model']); pass --optim-key" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "torch.optim format" in capsys.readouterr().out
