from __future__ import annotations

import os
import sys

import pytest
import torch

# Without a GPU the Triton kernels run on CPU tensors in Triton's interpreter, which must be
# switched on before Triton is imported (zeroshard.kernels imports it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist two workers share the cores: one intra-op thread each (and in the processes they start), not two
# OpenMP teams spinning against each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))  # the shared helpers and child scripts

from rank_pool import RankPool


class Pools:
    """One :class:`RankPool` per world size, started on first use and shared by the whole session."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def __getitem__(self, world_size: int) -> RankPool:
        if world_size not in self._pools:
            self._pools[world_size] = RankPool(world_size)
        return self._pools[world_size]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close(force=True)  # the session is over: no rank has anything left to finish


@pytest.fixture(scope="session")
def pools():
    pools = Pools()
    yield pools
    pools.close()
