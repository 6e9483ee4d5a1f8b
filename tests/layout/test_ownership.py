"""Whole-param ownership (``zeroshard/layout/ownership.py``): the same on every rank and balanced, against the list-scheduling bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroshard.layout.ownership import ParamCost, assign_owners, elementwise_cost, muon_cost

shapes = st.lists(st.tuples(st.integers(1, 300), st.integers(1, 300)), min_size=0, max_size=40)


def _loads(costs: list[ParamCost], owners: list[int], world_size: int) -> tuple[list[float], list[float]]:
    total_work = sum(c.work for c in costs) or 1.0
    total_bytes = sum(c.state_bytes for c in costs) or 1
    weights = [c.work / total_work + c.state_bytes / total_bytes for c in costs]
    loads = [0.0] * world_size
    for w, owner in zip(weights, owners):
        loads[owner] += w
    return loads, weights


@settings(max_examples=200, deadline=None)
@given(shapes=shapes, world_size=st.integers(1, 8))
def test_every_rank_ends_within_one_param_of_the_mean(shapes, world_size):
    costs = [muon_cost(s) for s in shapes]
    owners = assign_owners(costs, world_size)
    assert owners == assign_owners(list(costs), world_size)  # computed from the shapes alone
    assert all(0 <= o < world_size for o in owners)
    loads, weights = _loads(costs, owners, world_size)
    if weights:  # Graham's bound for greedy list scheduling: max load <= mean + the largest item
        assert max(loads) <= sum(weights) / world_size + max(weights) + 1e-9


def test_equal_matrices_are_spread_evenly():
    owners = assign_owners([muon_cost((64, 64))] * 8, 4)
    assert sorted(owners) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_one_large_matrix_gets_a_rank_to_itself():
    costs = [muon_cost((1024, 1024))] + [muon_cost((32, 32))] * 6
    owners = assign_owners(costs, 2)
    assert owners[0] not in owners[1:]


def test_costs():
    # Newton-Schulz on 64 x 256, 5 steps: 5 * (4 * 64^2 * 256 + 2 * 64^3) flops; one fp32 momentum.
    assert muon_cost((64, 256)) == ParamCost(5 * (4 * 64 * 64 * 256 + 2 * 64**3), 64 * 256 * 4, (64, 256))
    assert muon_cost((256, 64)) == ParamCost(5 * (4 * 64 * 64 * 256 + 2 * 64**3), 64 * 256 * 4, (256, 64))
    assert muon_cost((8, 3, 3, 3)).state_bytes == 8 * 27 * 4  # a conv filter as 8 x 27
    assert elementwise_cost((10, 10), 8) == ParamCost(100.0, 800, (10, 10))


def test_equal_cost_shapes_are_dealt_round_robin():
    # A tall and a wide matrix cost the same; each rank gets its share of both, not all of one.
    shapes = [(256, 1024), (1024, 256)] * 4
    owners = assign_owners([muon_cost(s) for s in shapes], 2)
    for rank in (0, 1):
        assert sorted(s for s, o in zip(shapes, owners) if o == rank) == [(256, 1024)] * 2 + [(1024, 256)] * 2


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"shape=\(7,\) has 1 dims"):
        muon_cost((7,))
    with pytest.raises(ValueError, match="world_size=0"):
        assign_owners([elementwise_cost((3,), 8)], 0)
