"""What every suite shares: timing statistics, ratios, rank spawning, tables, stamped CSV files."""

from __future__ import annotations

import csv
import datetime
import os
import platform
import queue
import shutil
import socket
import statistics
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

RESULTS_DIR = Path(__file__).parent / "results"
# Imported once by the fork server every rank is forked from, so that no rank imports them again: what a rank would
# import lazily costs seconds per rank on 2 cores (DDP's construction imports torch._dynamo; the example imports DCP).
# None of them makes a CUDA call on import, so a fork may still use any GPU.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.fsdp", "zeroshard"]


@dataclass(frozen=True)
class Timing:
    """Repeated measurements of one thing, in seconds, summarized by median and 20th/80th percentiles."""

    name: str
    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def p20(self) -> float:
        return percentile(self.samples, 20)

    @property
    def p80(self) -> float:
        return percentile(self.samples, 80)


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between order statistics.

    Raises:
        ValueError: on no samples or ``q`` outside [0, 100].
    """
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError(f"q={q} must be in [0, 100]")
    ordered = sorted(samples)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# Every table's ``ratio`` column means this; its legend says so in these words.
RATIO_LEGEND = "ratio = method's median time / baseline's (below 1.0: method faster)"


def ratio(subject: Timing, baseline: Timing) -> float:
    """``subject.median / baseline.median``: below 1.0 means the subject is faster (see ``RATIO_LEGEND``)."""
    return subject.median / baseline.median


def device_name() -> str:
    """The accelerator's name, or the CPU's model name with its core count."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model} ({os.cpu_count()} cores)"


def stamp() -> dict[str, str]:
    """Device, torch version and UTC date: the columns every CSV row starts with."""
    return {
        "device": device_name(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    }


def measured_on() -> str:
    """The line under a suite's tables that says where and when it ran: the stamp of its CSV rows."""
    head = stamp()
    return f"measured on {head['device']}, torch {head['torch']}, {head['date']} (UTC)"


def write_csv(suite: str, rows: list[dict[str, Any]], out_dir: Path = RESULTS_DIR) -> Path:
    """Write ``rows`` (stamped) to ``out_dir/<suite>-<date>-<device>.csv``; return the path.

    Raises:
        ValueError: on no rows.
    """
    if not rows:
        raise ValueError(f"suite {suite!r} produced no rows")
    head = stamp()
    slug = "".join(c if c.isalnum() else "-" for c in head["device"].lower()).strip("-")[:40]
    path = Path(out_dir) / f"{suite}-{head['date']}-{slug}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(head) + list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({**head, **row})
    return path


@dataclass(frozen=True)
class Table:
    """Which of a suite's rows print as one table, and the line under it that explains the columns."""

    kinds: tuple[str, ...]  # the rows' ``kind`` values; () takes every row
    legend: str

    def select(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The rows of this table, in the suite's order."""
        return [row for row in rows if not self.kinds or row.get("kind") in self.kinds]


def format_table(rows: list[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A plain-text table of ``rows`` (floats to 4 significant digits).

    ``columns`` defaults to every key that has a value other than ``""`` in some row."""
    if columns is None:
        columns = [k for k in dict.fromkeys(k for row in rows for k in row) if any(row.get(k, "") != "" for row in rows)]

    def cell(value: Any) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    body = [[cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in body)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def progress(suite: str, phase: str) -> None:
    """Print ``<suite>: <phase> ...`` at once, so a long phase shows it has started."""
    print(f"{suite}: {phase} ...", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, world_size: int, store_path: str, port: int, fn: Callable[..., Any], args: tuple, results: Any) -> None:
    import torch.distributed as dist

    # The launcher's variables, as torchrun sets them (DeepSpeed's init_distributed looks for all five), but the group meets
    # through a FileStore: the port is never bound, so another process (a second bench, a test worker) taking it first is harmless.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    init = {"init_method": f"file://{store_path}", "rank": rank, "world_size": world_size}
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank % torch.cuda.device_count()), **init)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group("gloo", **init)
    code = 0
    try:
        results.put((rank, fn(*args)))
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        dist.destroy_process_group()
    # Deliver the result, then skip interpreter finalization: with torch 2.13 + gloo a rank
    # sometimes aborts there after a clean destroy_process_group (examples/train_gpt.py says more).
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class NotEnoughGPUs(RuntimeError):
    """A suite needs more ranks than this machine has GPUs: NCCL runs one rank per GPU."""


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 900) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned ranks (gloo on CPU, NCCL on GPU); results by rank.

    Raises:
        NotEnoughGPUs: CUDA is visible with fewer GPUs than ``world_size`` (NCCL refuses two ranks on
            one GPU: "Duplicate GPU detected"); raised before any process starts.
        RuntimeError: a rank exited without a result, or not all answered within ``timeout`` seconds.
    """
    if torch.cuda.is_available() and torch.cuda.device_count() < world_size:
        raise NotEnoughGPUs(f"{fn.__module__}.{fn.__name__} needs {world_size} ranks, one per GPU, and this machine has "
                            f"{torch.cuda.device_count()} GPU(s); CUDA_VISIBLE_DEVICES= runs it on CPU ranks with gloo")
    ctx = mp.get_context("forkserver")  # ranks forked from one server that imported torch once, not each importing it
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    results = ctx.Queue()
    port = _free_port()
    store_dir = tempfile.mkdtemp(prefix="zeroshard-bench-")
    store_path = os.path.join(store_dir, "store")
    procs = [ctx.Process(target=_rank_entry, args=(r, world_size, store_path, port, fn, args, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    answers: dict[int, Any] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(answers) < world_size:
            try:
                rank, value = results.get(timeout=1.0)
                answers[rank] = value
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) or datetime.datetime.now() > deadline:
                    raise RuntimeError(f"{fn.__name__}: ranks {sorted(set(range(world_size)) - set(answers))} gave no result (exit codes "
                                       f"{[p.exitcode for p in procs]})") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(store_dir, ignore_errors=True)
    return [answers[r] for r in range(world_size)]
