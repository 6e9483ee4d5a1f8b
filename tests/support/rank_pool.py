"""A persistent pool of gloo rank processes that runs test functions on every rank.

Spawning a rank costs seconds (importing torch), so each world size gets one pool per test
session. ``RankPool.run(fn, *args)`` sends ``fn`` to every rank and returns the per-rank results;
an exception on any rank is re-raised here. A run that outlasts its timeout kills the pool (a
hang is a failure, never a wait) and the next ``run`` starts a fresh one.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

PROCESS_GROUP_TIMEOUT_S = 60
# Imported once by the fork server that forks every rank: a rank then starts in a fraction of a second, not the
# seconds importing torch costs (a pool restarts after each test whose ranks raised).
# torch._dynamo: DDP's constructor imports it; DCP: the checkpoint tests use it.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint", "zeroshard"]


def _worker(rank: int, world_size: int, store_path: str, tasks: Any, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",  # a FileStore: no port to pick, none to race for
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
    )
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(*args)))
        except BaseException as error:  # report everything, keep serving
            text = traceback.format_exc()
            try:
                pickle.dumps(error)
            except Exception:
                error = RuntimeError(text)
            results.put((rank, False, (error, text)))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` spawned processes in one gloo process group, serving test functions."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._procs: list[Any] = []
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        store_path = os.path.join(tempfile.mkdtemp(prefix="zeroshard-pool-"), "store")
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, args=(rank, self.world_size, store_path, self._tasks[rank], self._results), daemon=True)
            for rank in range(self.world_size)
        ]
        for proc in self._procs:
            proc.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 180.0) -> list[Any]:
        """Run ``fn(*args)`` on every rank; return the results ordered by rank.

        Raises:
            TimeoutError: not every rank answered within ``timeout`` seconds (the pool is restarted).
            BaseException: the first rank's exception, with the rank's traceback as a note.
        """
        if not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for q in self._tasks:
            q.put((fn, args))
        deadline = time.monotonic() + timeout
        answers: dict[int, tuple[bool, Any]] = {}
        while len(answers) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(answers))
                    self.close()
                    self._start()
                    why = f"rank processes {dead} died" if dead else f"no answer within {timeout} s (hang?)"
                    raise TimeoutError(f"{fn.__name__} did not finish on ranks {missing}: {why}") from None
                continue
            answers[rank] = (ok, value)
        if not all(ok for ok, _ in answers.values()):
            # A rank that raised may have left the others mid-collective (a polite exit would wait out the group's
            # timeout in destroy_process_group): kill them and start clean.
            self.close(force=True)
            self._start()
        for rank in range(self.world_size):
            ok, value = answers[rank]
            if not ok:
                error, text = value
                error.add_note(f"--- raised on rank {rank} of {self.world_size}:\n{text}")
                raise error
        return [answers[rank][1] for rank in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        """Stop the rank processes (politely, then by force; at once with ``force``)."""
        for q, proc in zip(self._tasks, self._procs):
            if proc.is_alive() and not force:
                q.put(None)
        for proc in self._procs:
            proc.join(timeout=0 if force else 5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
