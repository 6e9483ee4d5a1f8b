"""Turning param groups into sharded flat buffers: check, compare across ranks, flatten, broadcast.

See [Note: zeroshard buffers] in ``zeroshard/layout/flat_buffer.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.comm import collectives
from zeroshard.comm.groups import ShardingGroups
from zeroshard.layout.flat_buffer import FlatParamBuffer, is_sharded, param_name
from zeroshard.layout.local_shard import LocalShard
from zeroshard.layout.ownership import assign_owners, param_costs
from zeroshard.reduce.coordinator import take_over
from zeroshard.validation import check_params, check_whole_param_steps


@dataclass
class NewShards:
    """The result of :func:`shard_param_groups`.

    Attributes:
        group_params: per sharded param group, its original params in the user's order (frozen
            ones included).
        shards: the new local shards, each group's (one per dtype of its trainable params) in
            group order; each knows its group and its params' ``torch.optim`` indices.
        device: the device all params are on.
    """

    group_params: list[list[nn.Parameter]]
    shards: list[LocalShard]
    device: torch.device


def bucket_numel(bucket_size_mb: float, dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in ``bucket_size_mb`` MiB (at least 1)."""
    return max(1, int(bucket_size_mb * 2**20) // dtype.itemsize)


def shard_param_groups(
    optimizer: torch.optim.Optimizer,
    indices: range,
    groups: ShardingGroups,
    *,
    bucket_size_mb: float,
    device: torch.device | None,
    first_shard: int,
    first_param_index: int,
    host_master: bool = False,
    params_of: list[list[nn.Parameter]] | None = None,
    already_sharded: frozenset[int] = frozenset(),
    partition: str = "flat",
    master_weights: bool = True,
) -> NewShards:
    """Flatten, broadcast and shard param groups ``indices`` of ``optimizer``.

    Local checks first; then one fingerprint all-gather per group of ranks (a mismatch raises on
    every rank, naming it, before any size-dependent collective); then the broadcast from rank 0;
    finally each group's ``"params"`` is replaced by this rank's virtual parameters (or, when
    ``already_sharded`` is given, the new virtual parameters are appended to them).

    Args:
        optimizer: the wrapped optimizer.
        indices: the param groups to shard.
        groups: the shard (and replicate) groups.
        bucket_size_mb: bucket size in MiB of the param dtype.
        device: the device of the params sharded before, or ``None``.
        first_shard: how many shards the optimizer already has.
        first_param_index: how many params the groups before ``indices`` hold (``torch.optim``
            numbers params across groups in order).
        host_master: keep master weights in host memory (CPU offload).
        params_of: per group, its original params in the user's order (default: the groups'
            ``"params"``, which must not be virtual params yet).
        already_sharded: ids of params in flat buffers already: left out (params frozen at
            construction and trainable now are sharded this way, see ``ShardedOptimizer``).
        partition: ``"flat"`` (each rank owns ``1/N`` of every bucket) or ``"param"`` (each param
            owned whole by one rank, chosen by :func:`~zeroshard.layout.ownership.assign_owners`).
        master_weights: keep fp32 master weights for 16-bit params (see :class:`~zeroshard.layout.local_shard.LocalShard`).

    Raises:
        ValueError: from :func:`~zeroshard.validation.check_params`, or params that differ
            between ranks.
    """
    if params_of is None:
        params_of = [list(dict.fromkeys(optimizer.param_groups[g]["params"])) for g in indices]
    device = check_params(params_of, indices, device, first=first_shard == 0)
    if partition == "param":
        check_whole_param_steps(optimizer, indices, params_of)
    taken = [(p, param_name(g, j)) for g, params in zip(indices, params_of) for j, p in enumerate(params)
             if is_sharded(p) and id(p) not in already_sharded]
    take_over([p for p, _ in taken], [name for _, name in taken])
    fingerprint = [
        (param_name(g, j), tuple(p.shape), str(p.dtype), p.requires_grad)
        for g, params in zip(indices, params_of)
        for j, p in enumerate(params)
    ]
    for group in groups.all():
        collectives.check_same_on_all_ranks("param", fingerprint, group)

    buffers: list[tuple[FlatParamBuffer, int, list[int]]] = []  # (buffer, its param group, its params' torch.optim indices)
    index = first_param_index
    for g, params in zip(indices, params_of):
        trainable = [p for p in params if is_sharded(p) and id(p) not in already_sharded]
        index_of = {id(p): index + j for j, p in enumerate(params)}
        name_of = {id(p): param_name(g, j) for j, p in enumerate(params)}
        index += len(params)
        for dtype in dict.fromkeys(p.dtype for p in trainable):
            # Reverse registration order approximates the order gradients become ready.
            same_dtype = [p for p in reversed(trainable) if p.dtype == dtype]
            owners = assign_owners(param_costs(optimizer, optimizer.param_groups[g], same_dtype), groups.shard_size) if partition == "param" else None
            buffer = FlatParamBuffer(same_dtype, bucket_numel(bucket_size_mb, dtype), groups.shard_size, [name_of[id(p)] for p in same_dtype], owners)
            buffers.append((buffer, g, [index_of[id(p)] for p in same_dtype]))
    frozen = [p.data for params in params_of for p in params if not is_sharded(p)] if not already_sharded else []
    # Replicas take replica 0's values, then each shard group its first rank's: all equal rank (0, 0).
    for group in reversed(groups.all()):
        if dist.get_world_size(group) > 1:
            collectives.broadcast_from_first_([b.data for b, _, _ in buffers] + frozen, group)

    rank = dist.get_rank(groups.shard)
    shards = [LocalShard(buffer, rank, host_master, group=g, param_indices=indices_of, master_weights=master_weights) for buffer, g, indices_of in buffers]
    for g in indices:
        virtual = [v for shard in shards if shard.group == g for v in shard.virtual_params]
        optimizer.param_groups[g]["params"] = (optimizer.param_groups[g]["params"] if already_sharded else []) + virtual
    shard_initial_state(optimizer, shards)
    return NewShards(params_of, shards, device)


@torch.no_grad()
def shard_initial_state(optimizer: torch.optim.Optimizer, shards: list[LocalShard]) -> None:
    """Move the state ``optimizer`` created at construction for the params of ``shards`` onto their virtual params.

    ``torch.optim.Adagrad`` creates its ``sum`` (``initial_accumulator_value``) and ``step`` in
    ``__init__``, keyed by the original params, and reads them at its first step. Each virtual
    param gets its piece of every param-shaped state tensor and a copy of every other entry
    (``step``); the original params' entries are dropped. A frozen param keeps its entry until it
    is unfrozen and sharded (see ``ShardedOptimizer._shard_unfrozen``).
    """
    if not optimizer.state:
        return
    for shard in shards:
        for piece, vparam in zip(shard.pieces, shard.virtual_params):
            param = shard.buffer.params[piece.param]
            state = optimizer.state.get(param)
            if state:
                optimizer.state[vparam] = {
                    key: value.reshape(-1)[piece.param_offset : piece.param_offset + piece.numel].clone().view(vparam.shape)
                    if torch.is_tensor(value) and value.shape == param.shape and value.dim() > 0
                    else (value.clone() if torch.is_tensor(value) else value)
                    for key, value in state.items()
                }
    for shard in shards:
        for param in shard.buffer.params:
            optimizer.state.pop(param, None)
