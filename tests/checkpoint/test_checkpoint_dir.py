"""Crash safety: a save killed midway, truncated and corrupted files."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from models import TinyNet, param_groups
from torchrun_child import SUPPORT, TORCHRUN

import zeroshard


def load_worker(directory: str) -> tuple[int, list[int]]:
    torch.manual_seed(3)
    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), bucket_size_mb=100 * 4 / 2**20)
    zeroshard.verify_checkpoint(directory)
    state = {"model": model.state_dict(), "optim": opt}
    dcp.load(state, checkpoint_id=directory)
    return len(opt.state), sorted(set(opt._shard_set.param_steps))


def test_save_killed_midway_leaves_previous_checkpoint_loadable(pools, tmp_path):
    marker = tmp_path / "stalled"
    command = [*TORCHRUN, "--nproc_per_node", "2", str(SUPPORT / "crash_save_child.py"), str(tmp_path), str(marker)]
    child = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while not marker.exists():
            assert child.poll() is None, "the child exited before stalling"
            assert time.monotonic() < deadline, "the child never reached the stalled save"
            time.sleep(0.2)
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # every rank, mid-save
        child.wait(timeout=60)
    assert list((tmp_path / "step_4").glob("*.distcp")), "the killed save wrote no data files"
    assert zeroshard.latest_checkpoint(tmp_path) == tmp_path / "step_2"
    with pytest.raises(ValueError, match=r"step_4/\.metadata is missing: .* incomplete checkpoint"):
        zeroshard.verify_checkpoint(tmp_path / "step_4")
    for states, steps in pools[2].run(load_worker, str(tmp_path / "step_2")):
        assert states > 0 and steps == [0, 2]  # the frozen param, and two steps for the rest


def save_worker(directory: str) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2))
    dcp.save({"model": model.state_dict(), "optim": opt}, checkpoint_id=directory)


def damaged_load_worker(directory: str) -> tuple[str, str]:
    """What verify_checkpoint says, and what a plain dcp.load does (it must raise, not hang)."""
    try:
        zeroshard.verify_checkpoint(directory)
        verdict = "no error"
    except ValueError as error:
        verdict = str(error)
    torch.manual_seed(0)
    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2))
    try:
        dcp.load({"model": model.state_dict(), "optim": opt}, checkpoint_id=directory)
        plain = "loaded"
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        plain = type(error).__name__
    dist.barrier()
    return verdict, plain


@pytest.mark.parametrize("damage", ["truncate", "corrupt"])
def test_damaged_file_is_named_on_every_rank(pools, tmp_path, damage):
    pools[2].run(save_worker, str(tmp_path))
    victim = max(tmp_path.glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    if damage == "truncate":
        victim.write_bytes(bytes(data[: len(data) // 2]))
    else:  # same length, scrambled in the middle
        middle = len(data) // 2
        data[middle - 64 : middle + 64] = bytes(128)
        data[:4] = b"XXXX"
        victim.write_bytes(bytes(data))
    for verdict, plain in pools[2].run(damaged_load_worker, str(tmp_path)):
        assert victim.name in verdict and ("truncated" in verdict if damage == "truncate" else "corrupted" in verdict), verdict
        assert plain != "loaded"


def test_latest_checkpoint_goes_by_the_step_in_the_name_then_by_time(tmp_path):
    # A copy or restore (cp -r) gives the files new times in any order: the names still say which step is latest.
    for name in ("step_000010", "step_000003", "step_000004"):
        (tmp_path / name).mkdir()
        (tmp_path / name / ".metadata").write_bytes(b"")
    later = time.time_ns() + 10**12
    os.utime(tmp_path / "step_000003" / ".metadata", ns=(later, later))  # written last
    (tmp_path / "step_000011").mkdir()  # a save that did not finish
    assert zeroshard.latest_checkpoint(tmp_path) == tmp_path / "step_000010"
    (tmp_path / "final").mkdir()  # a name without a number: the times decide
    (tmp_path / "final" / ".metadata").write_bytes(b"")
    assert zeroshard.latest_checkpoint(tmp_path) == tmp_path / "step_000003"
    assert zeroshard.latest_checkpoint(tmp_path / "missing") is None
