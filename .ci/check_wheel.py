"""Check an installed zeroshard wheel: ``python check_wheel.py WHEEL``, run outside the source tree.

The wheel holds only ``zeroshard/`` (every module of the source tree, with ``zeroshard/kernels/``) and its dist-info; ``zeroshard``
and ``zeroshard.kernels`` import from site-packages; no top-level ``kernels`` (which would shadow
the distribution transformers imports), ``bench``, ``tests`` or ``examples`` package is installed;
the frameworks are not, and the adapters say how to get them.
"""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path

wheel = Path(sys.argv[1])
top_level = {name.split("/", 1)[0] for name in zipfile.ZipFile(wheel).namelist()}
unexpected = sorted(name for name in top_level if name != "zeroshard" and not name.endswith(".dist-info"))
if unexpected:
    sys.exit(f"{wheel.name} installs unexpected top-level entries: {unexpected}")

# Every module of the source tree is in the wheel (a subpackage missing from pyproject.toml's list would not be).
source = Path(__file__).resolve().parents[1]
names = set(zipfile.ZipFile(wheel).namelist())
expected = {str(p.relative_to(source)) for p in (source / "zeroshard").rglob("*.py")}
expected |= {"zeroshard/kernels/" + p.name for p in (source / "kernels").glob("*.py")}
missing = sorted(expected - names)
if missing:
    sys.exit(f"{wheel.name} lacks {missing}: list their packages under [tool.setuptools] packages in pyproject.toml")

import zeroshard  # noqa: E402
import zeroshard.kernels  # noqa: E402

if "site-packages" not in Path(zeroshard.__file__).parts:
    sys.exit(f"zeroshard imported from {zeroshard.__file__}, not from the installed wheel")
stray = [name for name in ("kernels", "bench", "tests", "examples") if importlib.util.find_spec(name) is not None]
if stray:
    sys.exit(f"the wheel installed top-level packages {stray}")
# The frameworks and safetensors are the "integrations" extra, not dependencies: the wheel alone
# does not install them, and each adapter, imported without its framework, names the extra.
installed = [name for name in ("transformers", "accelerate", "lightning", "safetensors") if importlib.util.find_spec(name) is not None]
if installed:
    sys.exit(f"installing the wheel installed {installed}: they belong to the integrations extra")
for adapter in ("hf", "accelerate"):
    try:
        importlib.import_module(f"zeroshard.integrations.{adapter}")
    except ModuleNotFoundError as error:
        if "zeroshard[integrations]" not in str(error):
            sys.exit(f"zeroshard.integrations.{adapter} without its framework does not name the extra: {error}")
    else:
        sys.exit(f"zeroshard.integrations.{adapter} imported without its framework")
importlib.import_module("zeroshard.convert")  # its torch.save output needs no extra

print(f"{wheel.name}: {sorted(top_level)}; zeroshard {zeroshard.__version__} imports from {Path(zeroshard.__file__).parent}")
