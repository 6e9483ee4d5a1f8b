"""Optimizer state dicts: this rank's shard, self-describing, saved and loaded with no collective.

See [Note: zeroshard buffers] in ``zeroshard/flat_buffer.py`` for the buffers named here.
"""

from __future__ import annotations

from typing import Any

import torch

from zeroshard.local_shard import LocalShard

SHARD_FORMAT = "zeroshard.shard"
SHARD_FORMAT_VERSION = 1


def layout_signature(shards: list[LocalShard]) -> list[tuple[Any, ...]]:
    """Per flat buffer: (dtype, param sizes, padded bucket sizes). Equal signatures mean equal shards."""
    return [
        (str(s.buffer.dtype), tuple(slot.numel for slot in s.buffer.layout.slots), tuple(b.padded_numel for b in s.buffer.layout.buckets))
        for s in shards
    ]


def shard_state_dict(optimizer: torch.optim.Optimizer, shards: list[LocalShard], *, rank: int, world_size: int, stage: int) -> dict[str, Any]:
    """This rank's shard of the optimizer state, in ``torch.optim`` format plus a ``"zeroshard"`` entry.

    Args:
        optimizer: the wrapped optimizer, whose params are this rank's virtual parameters.
        shards: the local shards, in flat-buffer order.
        rank, world_size, stage: recorded so a load elsewhere is refused.

    Returns:
        ``{"state", "param_groups"}`` as ``optimizer.state_dict()`` gives them (indexed by virtual
        parameter), and ``"zeroshard"``: ``format``, ``version``, ``rank``, ``world_size``,
        ``stage``, ``layout`` (:func:`layout_signature`) and ``master`` (per flat buffer: the 1-D
        fp32 master shard of 16-bit params, or ``None``). Tensors are references, not copies, as
        in ``torch.optim``.
    """
    inner = optimizer.state_dict()
    return {
        "state": inner["state"],
        "param_groups": inner["param_groups"],
        "zeroshard": {
            "format": SHARD_FORMAT,
            "version": SHARD_FORMAT_VERSION,
            "rank": rank,
            "world_size": world_size,
            "stage": stage,
            "layout": layout_signature(shards),
            "master": [s.master for s in shards],
        },
    }


def load_shard_state_dict(optimizer: torch.optim.Optimizer, shards: list[LocalShard], state_dict: dict[str, Any], *, rank: int, world_size: int) -> None:
    """Load a dict from :func:`shard_state_dict` saved on the same rank, world size and layout.

    Everything is checked before anything is written.

    Raises:
        ValueError: not a zeroshard shard, another format version, another rank or world size,
            another layout, or master shards of the wrong shape; the message names the mismatch.
    """
    meta = state_dict.get("zeroshard") if isinstance(state_dict, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != SHARD_FORMAT:
        raise ValueError("state_dict is not a zeroshard shard state dict (it has no 'zeroshard' entry with format 'zeroshard.shard'); this version loads only shards saved by ShardedOptimizer.state_dict()")
    if meta.get("version") != SHARD_FORMAT_VERSION:
        raise ValueError(f"state_dict has shard format version {meta.get('version')!r}; this version reads {SHARD_FORMAT_VERSION}")
    for key, mine in (("rank", rank), ("world_size", world_size)):
        if meta.get(key) != mine:
            raise ValueError(f"state_dict was saved with {key}={meta.get(key)!r}, this optimizer has {key}={mine}; a shard loads only on the rank and world size that saved it")
    theirs_layout = [tuple(entry) for entry in meta.get("layout", [])]
    my_layout = layout_signature(shards)
    if theirs_layout != my_layout:
        for k, (theirs, ours) in enumerate(zip(theirs_layout, my_layout)):
            if theirs != ours:
                raise ValueError(f"state_dict flat buffer {k} has (dtype, param sizes, bucket sizes) {theirs}, this optimizer {ours}: saved for another model or bucket_size_mb")
        raise ValueError(f"state_dict has {len(theirs_layout)} flat buffers, this optimizer {len(my_layout)}: saved for another model")
    masters = meta.get("master", [])
    for k, (shard, master) in enumerate(zip(shards, masters)):
        expected = None if shard.master is None else tuple(shard.master.shape)
        found = None if master is None else tuple(master.shape)
        if found != expected:
            raise ValueError(f"state_dict master shard {k} has shape {found}, expected {expected}")
    optimizer.load_state_dict({"state": state_dict["state"], "param_groups": state_dict["param_groups"]})
    with torch.no_grad():
        for shard, master in zip(shards, masters):
            if master is not None:
                shard.master.copy_(master)
