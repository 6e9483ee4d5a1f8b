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


# The longest files (their summed test time in one run on the 2-core machine, longest first), started first: pytest-xdist
# hands out whole files in collection order, and these, collected last by name, left one worker running them alone at the end.
LONGEST_FIRST = (
    "test_example.py", "test_bench.py", "checkpoint/test_checkpoint.py", "test_contract.py", "checkpoint/test_checkpoint_param.py",
    "test_parity.py", "reduce/test_ddp_wrap.py", "step/test_lowbit_state.py", "integrations/test_lightning.py", "step/test_shape_aware.py",
    "offload/test_offload.py", "step/test_loss_scaling.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    tests = os.path.dirname(__file__)
    rank = {os.path.join(tests, name): i for i, name in enumerate(LONGEST_FIRST)}
    if missing := [name for name in rank if not os.path.exists(name)]:
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names files that are gone: {missing}")
    items.sort(key=lambda item: rank.get(str(item.path), len(LONGEST_FIRST)))  # stable: each file's tests keep their order
