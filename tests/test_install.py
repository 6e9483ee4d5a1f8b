"""The library on its declared dependencies alone, and the wheel's contents."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_child import TORCHRUN

ROOT = Path(__file__).resolve().parents[1]

# What ``import zeroshard`` leaves for first use: DCP (checkpoint/dirs.py and checkpoint/sharded.py import it, and
# DTensor, inside the functions that use it), sympy (torch.distributed.tensor imports it; plain
# ``import torch`` does not), and the ``integrations`` extra.
IMPORTED_ON_USE = ("torch.distributed.checkpoint", "torch.distributed.tensor", "sympy", "transformers", "accelerate", "lightning", "safetensors")
EXTRA = ("transformers", "accelerate", "lightning", "safetensors")


def _blocked_env(tmp_path: Path, names: tuple[str, ...]) -> dict[str, str]:
    """The environment with each of ``names`` made unimportable (a package that raises on import, first on the path)."""
    blocker = tmp_path / "blocker"
    for name in names:
        (blocker / name).mkdir(parents=True)
        (blocker / name / "__init__.py").write_text(f"raise ModuleNotFoundError('{name} is blocked for this test', name='{name}')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")])}


def test_import_leaves_checkpoint_and_frameworks_for_first_use():
    code = f"import json, sys, zeroshard; print(json.dumps([name for name in {IMPORTED_ON_USE!r} if name in sys.modules]))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == [], "import zeroshard imported these at once; import them where they are used"


# Two threads import ``kernels``; the second starts once the first is running Hugging Face's package (its __file__ set).
_RACE = """
import sys, threading
found = []
def second():
    while "site-packages" not in str(getattr(sys.modules.get("kernels"), "__file__", "")):
        pass
    from kernels import get_kernel
    found.append(get_kernel.__module__)
thread = threading.Thread(target=second)
thread.start()
import kernels
thread.join()
print(found)
"""


def test_the_checkout_root_on_sys_path_leaves_hugging_faces_kernels_to_transformers(tmp_path):
    # ``python -m pytest`` in the checkout puts its root first on sys.path, where kernels/ (zeroshard.kernels) would be the
    # top-level ``kernels`` that transformers 5.25+ requires and imports (an ImportError in every HF model before).
    pytest.importorskip("transformers")
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's kernels package is not installed")
    code = "import kernels, transformers.activations, zeroshard.kernels as ours; print(kernels.__file__); print(ours.__file__)"
    (tmp_path / "checkout").symlink_to(ROOT)
    for env in ({}, {"PYTHONPATH": str(tmp_path / "checkout")}):  # the root also by another path (it imported itself until a RecursionError)
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, **env})
        assert result.returncode == 0, result.stderr[-3000:]
        theirs, ours = (Path(line) for line in result.stdout.splitlines()[-2:])
        assert ROOT not in theirs.parents and ours == ROOT / "kernels" / "__init__.py", (env, result.stdout)
    race = subprocess.run([sys.executable, "-c", _RACE], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert race.returncode == 0 and race.stdout.strip().startswith("['kernels."), race.stdout + race.stderr[-3000:]  # not half-imported


def test_without_the_extra_adapters_and_safetensors_output_name_it(tmp_path):
    code = """
import sys
import torch, torch.distributed.checkpoint as dcp
for adapter in ("accelerate", "hf"):
    try:
        __import__(f"zeroshard.integrations.{adapter}")
    except ModuleNotFoundError as error:
        print(adapter, error)
    else:
        sys.exit(f"zeroshard.integrations.{adapter} imported without its framework")
from zeroshard.convert import convert
dcp.save({"model": {"weight": torch.ones(3)}}, checkpoint_id=sys.argv[1])
try:
    convert(sys.argv[1], sys.argv[1] + ".safetensors")
except ModuleNotFoundError as error:
    print("convert", error)
"""
    env = _blocked_env(tmp_path, EXTRA)
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["accelerate", "hf", "convert"], result.stdout
    for line in lines:
        assert "pip install 'zeroshard[integrations]'" in line, line


def test_construct_step_save_and_load_without_numpy(tmp_path):
    # torch >= 2.13 pickles object collectives through NumPy; zeroshard must not need them.
    blocker = tmp_path / "blocker" / "numpy"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ModuleNotFoundError('numpy is blocked for this test', name='numpy')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker.parent), os.environ.get("PYTHONPATH", "")])}
    command = [*TORCHRUN, "--nproc_per_node", "2", str(ROOT / "tests" / "support" / "no_numpy_child.py"), str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "no-numpy ok" in result.stdout
