"""Thin typed wrappers over the ``torch.distributed`` collectives zeroshard uses.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of
``all_gather_single`` / ``reduce_scatter_single``; the wrappers take the new names where they
exist and fall back to the old ones on torch 2.4 - 2.12.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter(output: Tensor, input: Tensor, group: ProcessGroup) -> dist.Work:
    """Start a sum reduce-scatter: rank r receives the sum over ranks of ``input[r*n:(r+1)*n]``.

    Args:
        output: 1-D, ``n`` elements, same dtype and device as ``input``; written when the work completes.
        input: 1-D, ``n * group.size()`` elements.
        group: the sharding process group.

    Returns:
        The async work handle; call ``wait()`` before reading ``output``.
    """
    return _reduce_scatter_single(output, input, group=group, async_op=True)


def all_gather(output: Tensor, input: Tensor, group: ProcessGroup) -> dist.Work:
    """Start an all-gather: ``output[r*n:(r+1)*n]`` receives rank r's ``input``.

    ``input`` may be this rank's own slot of ``output`` (an in-place gather), which is how
    zeroshard gathers updated slices back into the flat param buffer.

    Args:
        output: 1-D, ``n * group.size()`` elements.
        input: 1-D, ``n`` elements, same dtype and device as ``output``.
        group: the sharding process group.

    Returns:
        The async work handle; call ``wait()`` before reading ``output``.
    """
    return _all_gather_single(output, input, group=group, async_op=True)


def all_reduce_max_(tensor: Tensor, group: ProcessGroup) -> None:
    """In-place element-wise maximum of ``tensor`` over the ranks of ``group`` (blocking)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)


def broadcast_from_first_(tensors: Sequence[Tensor], group: ProcessGroup) -> None:
    """Overwrite ``tensors`` on every rank with those of the group's rank 0 (blocking)."""
    src = dist.get_global_rank(group, 0)
    works = [dist.broadcast(t, src=src, group=group, async_op=True) for t in tensors]
    for work in works:
        work.wait()


def check_same_on_all_ranks(what: str, fingerprint: Sequence[tuple[Any, ...]], group: ProcessGroup) -> None:
    """Raise on every rank if any rank's ``fingerprint`` differs from that of the group's rank 0.

    One ``all_gather_object`` of small Python tuples. Run it before the first collective whose
    tensor sizes depend on the fingerprint: gloo aborts the process (not an exception) when
    ranks pass tensors of different sizes.

    Args:
        what: a name for the entries, used in the error (e.g. ``"param"``).
        fingerprint: one tuple per entry; its first element names the entry in errors.
        group: the process group to compare over.

    Raises:
        ValueError: on every rank of ``group``, naming the first differing (global) rank, the
            entry and both values.
    """
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, list(fingerprint), group=group)
    reference, first = gathered[0], dist.get_global_rank(group, 0)
    for rank, theirs in enumerate(gathered[1:], start=1):
        if theirs == reference:
            continue
        rank = dist.get_global_rank(group, rank)
        for mine, other in zip(reference, theirs):
            if mine != other:
                raise ValueError(f"{what} {other[0]} on rank {rank} is {other[1:]}, on rank {first} {mine[1:]}; every rank must build the optimizer on the same params in the same order")
        raise ValueError(f"rank {rank} has {len(theirs)} {what}s, rank {first} has {len(reference)}; every rank must build the optimizer on the same params in the same order")
