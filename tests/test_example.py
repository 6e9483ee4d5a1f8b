"""The README's first quick-start command, shortened: the GPT example on 2 gloo ranks on real text."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_child import TORCHRUN

ROOT = Path(__file__).resolve().parents[1]


def _outside_torchrun() -> dict[str, str]:
    """The environment of a plain ``python train_gpt.py``: none of torchrun's variables."""
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}


def test_train_gpt_learns_on_two_ranks_checkpoints_and_resumes_offloaded_on_one(tmp_path):
    script = [str(ROOT / "examples" / "train_gpt.py"), "--ckpt-dir", str(tmp_path),
              "--ckpt-every", "6", "--log-interval", "6", "--eval-batches", "4"]
    first = subprocess.run(TORCHRUN + ["--nproc_per_node", "2"] + script + ["--steps", "12"], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "optimizer state per rank:" in first.stdout
    summary = re.search(r"done: 12 steps .* train loss ([\d.]+) -> ([\d.]+), val loss ([\d.]+) -> ([\d.]+)", first.stdout)
    assert summary, first.stdout[-3000:]
    train_before, train_after, val_before, val_after = map(float, summary.groups())
    assert val_after < val_before - 1.0 and train_after < train_before - 1.0, summary.group(0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000006", "step_000012"]
    # Resumed by a plain `python train_gpt.py` (one rank, no torchrun environment; tests/checkpoint resumes on more ranks),
    # its state offloaded, keeping on the "device" what the measured margin allows.
    resumed_offloaded = ["--steps", "14", "--resume", "--offload", "cpu", "--gpu-margin-mem-ratio", "0.5"]
    second = subprocess.run([sys.executable] + script + resumed_offloaded, capture_output=True, text=True, timeout=240, cwd=ROOT,
                            env=_outside_torchrun())
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "not launched by torchrun: training on 1 rank" in second.stderr
    assert re.search(r"gpu_margin_mem_ratio=0.5 of a [\d,]+ MiB margin .*: (\d+) of \1 chunks", second.stderr), second.stderr[-3000:]
    assert f"resumed from {tmp_path / 'step_000012'} (step 12) on 1 ranks" in second.stdout
    assert "done: 2 steps" in second.stdout


def test_kernels_installs_under_zeroshard_only(tmp_path):
    # Outside the checkout, a top-level ``kernels`` is Hugging Face's (transformers 5.25+ requires it) or none, never ours.
    probe = "import importlib.util, zeroshard.kernels; spec = importlib.util.find_spec('kernels'); print(spec and spec.origin)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    found = result.stdout.strip()
    assert found == "None" or ROOT not in Path(found).resolve().parents, found


def test_train_gpt_with_muon_shards_both_optimizers_learns_and_resumes_on_one_rank_outside_torchrun(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    # Half the example's width (its Muon step takes a third of the time on CPU), a higher learning rate to learn as fast.
    script = [str(ROOT / "examples" / "train_gpt.py"), "--optimizer", "muon", "--n-embd", "64", "--lr", "4e-3",
              "--ckpt-dir", str(tmp_path), "--ckpt-every", "5", "--log-interval", "5", "--eval-batches", "2"]
    first = subprocess.run(TORCHRUN + ["--nproc_per_node", "2"] + script + ["--steps", "10"],
                           capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    # Muon on the blocks' 16 weight matrices, each owned whole by one rank; AdamW on the other 36 params, in flat slices.
    assert re.search(r"^AdamW on 36 params .*: ShardedOptimizer\(stage=2, partition='flat'\)", first.stdout, re.M), first.stdout
    assert re.search(r"^Muon on 16 params .*: ShardedOptimizer\(stage=2, partition='param'\), rank 0 updates 8 of them whole",
                     first.stdout, re.M), first.stdout
    assert re.search(r"optimizer state per rank: [\d.]+ \+ [\d.]+ MiB .* unsharded AdamW \+ Muon would hold", first.stdout), first.stdout
    summary = re.search(r"done: 10 steps .* train loss ([\d.]+) -> ([\d.]+), val loss ([\d.]+) -> ([\d.]+)", first.stdout)
    assert summary, first.stdout[-3000:]
    train_before, train_after, val_before, val_after = map(float, summary.groups())
    assert val_after < val_before - 1.0 and train_after < train_before - 1.0, summary.group(0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000005", "step_000010"]
    saved = FileSystemReader(str(tmp_path / "step_000010")).read_metadata().state_dict_metadata
    assert {key.split(".")[0] for key in saved} >= {"model", "optim", "optim_muon", "schedule", "schedule_muon", "step"}, sorted(saved)[:20]
    # Resumed by a plain `python train_gpt.py`: one rank, no torchrun environment.
    second = subprocess.run([sys.executable] + script + ["--steps", "12", "--resume"], capture_output=True, text=True, timeout=240, cwd=ROOT,
                            env=_outside_torchrun())
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "not launched by torchrun: training on 1 rank" in second.stderr
    assert f"resumed from {tmp_path / 'step_000010'} (step 10) on 1 ranks" in second.stdout
    assert "done: 2 steps" in second.stdout


def _example_module():
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--steps", "-5"], "--steps -5: must be at least 1"),
    (["--batch-size", "0"], "--batch-size 0: must be at least 1"),
    (["--n-embd", "130"], "--n-embd 130 must be a multiple of --n-head 4"),
    (["--ckpt-every", "5"], "--ckpt-every needs --ckpt-dir"),
    (["--resume"], "--resume needs --ckpt-dir"),
    (["--gpu-margin-mem-ratio", "0.5"], "--gpu-margin-mem-ratio needs --offload cpu"),
    (["--optimizer", "muon", "--offload", "cpu"], "--offload cpu keeps torch AdamW state only: it cannot be used with --optimizer muon"),
    (["--optimizer", "adamw8bit", "--offload", "cpu"], "--offload cpu keeps torch AdamW state only: it cannot be used with --optimizer adamw8bit"),
    (["--optimizer", "lion"], "argument --optimizer: invalid choice: 'lion'"),
    (["--lr", "0"], "--lr 0.0: must be positive"),
    (["--data", "no/such/file.txt"], "--data no/such/file.txt: no such file"),
])
def test_train_gpt_refuses_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _example_module().parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_train_gpt_help_shows_every_default(capsys):
    module = _example_module()
    with pytest.raises(SystemExit):
        module.parse_args(["--help"])
    entries: dict[str, str] = {}  # option -> its whole help entry
    for line in capsys.readouterr().out.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            option = line.split()[0].rstrip(",")
            entries[option] = line
        elif entries:
            entries[option] += " " + line.strip()
    options = [o for o in entries if o not in ("-h", "--resume")]
    assert len(options) >= 18, entries
    for option in options:
        assert "(default: " in entries[option], entries[option]
