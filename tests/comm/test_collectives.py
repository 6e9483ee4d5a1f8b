"""The bucket collectives run point to point on gloo: same results as gloo's own, timeouts still raise."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from zeroshard.comm import collectives

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _native(fn, *args):
    collectives.POINT_TO_POINT_ON_GLOO = False
    try:
        return fn(*args)
    finally:
        collectives.POINT_TO_POINT_ON_GLOO = True


def _reduce_scatter(numel: int, dtype: torch.dtype, input_frozen: bool = False) -> torch.Tensor:
    world = dist.get_world_size()
    out = torch.full((numel,), float("nan"), dtype=dtype)
    inputs = torch.randn(world * numel, generator=torch.Generator().manual_seed(dist.get_rank())).to(dtype)
    before = inputs.clone()
    work = collectives.reduce_scatter(out, inputs, dist.group.WORLD, input_frozen=input_frozen)
    work.wait()
    if collectives.POINT_TO_POINT_ON_GLOO:  # ours leaves the input as it was (gloo's own reduces in it)
        assert work.is_completed() and torch.equal(inputs, before)
    return out


def _all_gather(numel: int, dtype: torch.dtype, in_place: bool) -> torch.Tensor:
    world, rank = dist.get_world_size(), dist.get_rank()
    out = torch.full((world * numel,), float("nan"), dtype=dtype)
    mine = torch.arange(numel, dtype=torch.float32).add(1000 * rank).to(dtype)
    if in_place:
        out[rank * numel : (rank + 1) * numel] = mine
        mine = out[rank * numel : (rank + 1) * numel]
    collectives.all_gather(out, mine, dist.group.WORLD).wait()
    return out


def collectives_worker(numel: int) -> list[tuple[str, bool, float]]:
    """Per case: (name, equal to gloo's own bitwise, largest difference from a float64 sum)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for dtype in DTYPES:
        ours, theirs = _reduce_scatter(numel, dtype), _native(_reduce_scatter, numel, dtype)
        every = [torch.randn(world * numel, generator=torch.Generator().manual_seed(r)).to(dtype).double() for r in range(world)]
        exact = sum(every)[rank * numel : (rank + 1) * numel]
        rows.append((f"reduce_scatter {dtype}", torch.equal(ours, theirs), float((ours.double() - exact).abs().max())))
        # Reading the own piece at wait() (a frozen input) sums in the same order: the same bits at any world size.
        rows.append((f"reduce_scatter {dtype} input_frozen", torch.equal(_reduce_scatter(numel, dtype, True), ours), 0.0))
        for in_place in (True, False):
            ours, theirs = _all_gather(numel, dtype, in_place), _native(_all_gather, numel, dtype, in_place)
            rows.append((f"all_gather {dtype} in_place={in_place}", torch.equal(ours, theirs), 0.0 if torch.equal(ours, theirs) else float("inf")))
    own = [dist.new_group([r]) for r in range(world)][rank]  # a group of one: the input is the result
    for frozen in (False, True):
        out, inputs = torch.full((7,), float("nan")), torch.randn(7)
        collectives.reduce_scatter(out, inputs, own, input_frozen=frozen).wait()
        rows.append((f"reduce_scatter group of one input_frozen={frozen}", torch.equal(out, inputs), 0.0))
    return rows


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_point_to_point_collectives_match_gloos_own(pools, world_size):
    for rows in pools[world_size].run(collectives_worker, 1001):
        for name, equal, error in rows:
            if name.startswith("all_gather") or "input_frozen" in name or world_size == 2:  # two ranks: one sum, a + b = b + a
                assert equal, (world_size, name)
            else:  # more: the order of the sum differs from gloo's ring, within one rounding per add
                tolerance = {"torch.float32": 1e-5, "torch.bfloat16": 0.1, "torch.float16": 0.02}[name.split()[1]]
                assert error <= tolerance, (world_size, name, error)


def silent_peer_worker() -> str:
    """Rank 1 never joins rank 0's all-gather: rank 0's wait must raise within its timeout, not hang.

    On a group of its own: rank 0's unmatched send and receive stay posted there, where no later
    test's messages can meet them.
    """
    group = dist.new_group(backend="gloo")
    if dist.get_rank() == 1:
        return ""
    out = torch.zeros(2 * 8)
    work = collectives.all_gather(out, out[:8], group)
    try:
        collectives.wait(work, datetime.timedelta(seconds=1), "the test's all-gather", "join")
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_point_to_point_gather_that_a_peer_skips_times_out(pools):
    message = pools[2].run(silent_peer_worker)[0]
    assert message.startswith("the test's all-gather did not complete within 1 s on rank 0"), message
