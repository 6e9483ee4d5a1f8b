"""Which rank owns which whole param, for optimizers whose update needs a param whole (issue #14).

Shape-aware optimizers (``torch.optim.Muon``, ``torch.optim.Adafactor``) cannot run on 1-D slices of params, so under
``partition="param"`` each param has one owner rank that keeps its state and runs its update. Ownership is computed from
the shapes alone, identically on every rank (no collective), balancing the update's work and the state bytes
(docs/shape_aware.md, "How ownership is balanced").
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ParamCost:
    """What owning one param costs its rank."""

    work: float  # the update's work, in flops (an estimate; only ratios matter)
    state_bytes: int  # the optimizer state the owner keeps for the param
    # Among params of equal cost, those of one shape are dealt out together, so each rank gets its share of every shape
    # (a tall and a wide matrix cost the same flops, but torch's Muon runs a tall one transposed, which is slower on CPU).
    shape: tuple[int, ...] = ()


def muon_cost(shape: Sequence[int], state_itemsize: int = 4, ns_steps: int = 5) -> ParamCost:
    """The cost of a param updated by Muon (Jordan et al., "Muon", 2024; ``torch.optim.Muon``): Newton-Schulz work and one
    momentum buffer. A param of more than 2 dims is costed as ``shape[0] x prod(shape[1:])``, as modded-nanogpt flattens
    conv filters (``torch.optim.Muon`` itself refuses such params).

    Args:
        shape: the param's shape (>= 2 dims).
        state_itemsize: bytes per element of the momentum buffer (4 for fp32).
        ns_steps: Newton-Schulz iterations per step.

    Raises:
        ValueError: ``shape`` has fewer than 2 dims (Muon updates matrices only).
    """
    if len(shape) < 2:
        raise ValueError(f"Muon updates matrices only: shape={tuple(shape)} has {len(shape)} dims")
    rows, cols = shape[0], math.prod(shape[1:])
    small, large = min(rows, cols), max(rows, cols)
    # Per iteration: A = X X^T (small x large x small), B = b A + c A A (small^3), X' = a X + B X (small^2 x large).
    work = ns_steps * (4 * small * small * large + 2 * small**3)
    return ParamCost(float(work), rows * cols * state_itemsize, tuple(shape))


def elementwise_cost(shape: Sequence[int], state_bytes_per_element: int) -> ParamCost:
    """The cost of a param updated element-wise (AdamW: 8 state bytes per fp32 element): both in proportion to its elements."""
    numel = math.prod(shape)
    return ParamCost(float(numel), numel * state_bytes_per_element, tuple(shape))


def assign_owners(costs: Sequence[ParamCost], world_size: int) -> list[int]:
    """The owner rank of each param, balancing work and state bytes.

    Each param costs the sum of its shares of the two totals and params go, most costly first, to the rank with the least
    cost so far (Graham's longest-processing-time rule, "Bounds on multiprocessing timing anomalies", 1969): every rank
    ends within one param's cost of the mean. Ties break by shape, index and rank, so every rank computes the same
    assignment, and equal-cost params of one shape are dealt round-robin.

    Args:
        costs: per param, in a fixed order (the optimizer's param order).
        world_size: the number of ranks that own params (the shard group's size).

    Returns:
        ``owners[i]`` in ``[0, world_size)`` for param ``i``; the same on every rank.

    Raises:
        ValueError: ``world_size`` below 1.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    total_work = sum(c.work for c in costs) or 1.0
    total_bytes = sum(c.state_bytes for c in costs) or 1
    weight = [c.work / total_work + c.state_bytes / total_bytes for c in costs]
    order = sorted(range(len(costs)), key=lambda i: (-weight[i], costs[i].shape, i))
    loads = [(0.0, rank) for rank in range(world_size)]  # a heap of (load, rank): least loaded, then lowest rank
    owners = [0] * len(costs)
    for i in order:
        load, rank = heapq.heappop(loads)
        owners[i] = rank
        heapq.heappush(loads, (load + weight[i], rank))
    return owners


def default_cost(shape: Sequence[int], dtype: torch.dtype) -> ParamCost:
    """:func:`elementwise_cost` with one master-dtype state element per param element (fp32 for 16-bit
    params): what :func:`param_costs` charges under any optimizer but Muon."""
    return elementwise_cost(shape, max(4, dtype.itemsize))


def param_costs(optimizer: torch.optim.Optimizer, group: dict[str, Any], params: Sequence[torch.Tensor]) -> list[ParamCost]:
    """The cost of each of ``params`` (of param group ``group``) under ``optimizer``'s update: ``torch.optim.Muon``'s
    matrices: :func:`muon_cost` with the group's ``ns_steps`` (fp32 momentum, or fp64 for fp64 params); otherwise
    :func:`default_cost` (Adafactor's factored state is smaller, but its work, like an element-wise update's, grows with
    the elements)."""
    if type(optimizer) is getattr(torch.optim, "Muon", None):
        return [muon_cost(p.shape, max(4, p.dtype.itemsize), int(group.get("ns_steps", 5))) if p.dim() >= 2
                else default_cost(p.shape, p.dtype) for p in params]
    return [default_cost(p.shape, p.dtype) for p in params]
