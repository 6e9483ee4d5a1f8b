"""Run a test's child script under torch.distributed.run and read the JSON result it prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SUPPORT = Path(__file__).parent  # tests/support: the helpers and the child scripts
ROOT = SUPPORT.parents[1]  # the repository
# torchrun on a free port (--standalone: its own rendezvous on localhost), so that test workers may launch it side by side.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def run_child(script: str, *args: str, result_prefix: str, nproc: int = 2, timeout_s: int = 240) -> dict:
    """Run ``tests/support/<script>`` on ``nproc`` gloo ranks; the JSON after ``result_prefix`` on its stdout.

    Raises:
        AssertionError: the run failed (its output's tail is in the message) or printed no result line.
    """
    command = [*TORCHRUN, "--nproc_per_node", str(nproc), str(SUPPORT / script), *args]
    run = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith(result_prefix + " ")]
    assert lines, run.stdout[-3000:]
    return json.loads(lines[0].split(" ", 1)[1])
