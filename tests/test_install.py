"""The library on its declared dependencies alone, and the wheel's contents."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_construct_step_save_and_load_without_numpy(tmp_path):
    # torch >= 2.13 pickles object collectives through NumPy; zeroshard must not need them.
    blocker = tmp_path / "blocker" / "numpy"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ModuleNotFoundError('numpy is blocked for this test', name='numpy')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker.parent), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(ROOT / "tests" / "no_numpy_child.py"), str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "no-numpy ok" in result.stdout
