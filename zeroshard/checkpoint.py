"""Optimizer checkpoints that load at any world size: a sharded (DCP) format and the full torch format.

See [Note: zeroshard buffers] in ``zeroshard/flat_buffer.py`` for the buffers named here.

Two formats, both world-size independent (bucket boundaries depend on the params and
``bucket_size_mb`` only, never on the world size):

* **sharded** (``ShardedOptimizer.state_dict()``): per bucket of every flat buffer, one 1-D
  ``DTensor`` per per-element state (``exp_avg``, ...) and for the fp32 master of 16-bit params,
  over the bucket's unpadded length with placement ``Shard(0)`` (``[Replicate(), Shard(0)]`` for
  hybrid meshes). ``Shard(0)`` splits like ``torch.chunk`` — ``ceil(n/N)`` per rank — which is
  exactly zeroshard's "pad to a multiple of N, ``1/N`` each", so every rank's slice is its local
  shard and ``torch.distributed.checkpoint`` reshards it onto any other world size. Built with no
  collective.
* **full** (after ``consolidate_state_dict``): plain ``torch.optim`` format keyed by the index of
  each param in the wrapped optimizer's ``param_groups`` (as ``torch.optim.Optimizer.state_dict``
  numbers them), param-shaped state, plus a ``"zeroshard"`` entry (format, param shapes and
  dtypes, fp32 masters, loss scaler) that plain torch ignores. Loads into an unsharded ``torch.optim`` optimizer
  and back, at any world size.

Per-param steps are kept replicated on every rank (``ShardedOptimizer._param_steps``): a param is
stepped exactly when it got a gradient on some rank, which every rank knows after ``step()``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from zeroshard.local_shard import LocalShard
from zeroshard.loss_scaler import DynamicLossScaler

try:  # torch >= 2.5
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch 2.4
    from torch.distributed._tensor import DTensor, Replicate, Shard

SHARDED_FORMAT = "zeroshard.sharded"
FULL_FORMAT = "zeroshard.full"
FORMAT_VERSION = 1


@dataclass
class CheckpointView:
    """What the checkpoint code reads and writes of a ``ShardedOptimizer``.

    Attributes:
        optimizer: the wrapped optimizer (its params are the virtual parameters).
        shards: the local shards, in flat-buffer order.
        group_params: per param group, the user's params in order (frozen ones included).
        param_index: per shard, per layout position: the param's index in ``torch.optim`` numbering.
        param_steps: per param (``torch.optim`` numbering): how many updates it has had; replicated.
        mesh: the device mesh the DTensors live on (1-D shard, or 2-D replicate x shard).
        shard_group: the process group that shares one copy of the state.
        loss_scaler: the dynamic loss scaler, whose state travels in both formats, or ``None``.
    """

    optimizer: torch.optim.Optimizer
    shards: list[LocalShard]
    group_params: list[list[nn.Parameter]]
    param_index: list[list[int]]
    param_steps: list[int]
    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    loss_scaler: DynamicLossScaler | None = None

    @property
    def rank(self) -> int:
        return dist.get_rank(self.shard_group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.shard_group)


# -- what the wrapped optimizer keeps ----------------------------------------------------------


def state_keys(optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> tuple[list[str], bool]:
    """The per-element state keys of ``optimizer`` (e.g. ``exp_avg``) and whether it keeps ``step``.

    Read from its state when it has some; otherwise from one step of a throwaway instance of the
    same class and defaults on a 2-element param (the optimizer itself is never touched).

    Raises:
        ValueError: the optimizer keeps scalar state other than ``step`` (e.g. NAdam's
            ``mu_product``), which zeroshard checkpoints do not carry.
    """
    sample = next((s for s in optimizer.state.values() if s), None)
    numel = None
    if sample is None:
        probe = nn.Parameter(torch.zeros(2, dtype=dtype))
        probe.grad = torch.zeros_like(probe)
        accepted = inspect.signature(type(optimizer).__init__).parameters
        throwaway = type(optimizer)([probe], **{k: v for k, v in optimizer.defaults.items() if k in accepted})
        throwaway.step()
        sample, numel = throwaway.state[probe], 2
    else:
        vparam = next(p for p, s in optimizer.state.items() if s)
        numel = vparam.numel()
    per_element = sorted(k for k, v in sample.items() if torch.is_tensor(v) and v.dim() > 0 and v.numel() == numel)
    scalars = sorted(k for k in sample if k not in per_element and k != "step")
    if scalars:
        raise ValueError(f"{type(optimizer).__name__} keeps scalar state {scalars}; zeroshard checkpoints carry per-element state and 'step' only")
    return per_element, "step" in sample


def _groups_without_params(optimizer: torch.optim.Optimizer, group_params: list[list[nn.Parameter]]) -> list[dict[str, Any]]:
    """Each group's hyperparameters, with ``"params"`` as ``torch.optim`` numbers them."""
    groups, start = [], 0
    for group, params in zip(optimizer.param_groups, group_params):
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + len(params)))})
        start += len(params)
    return groups


def layout_signature(view: CheckpointView) -> list[tuple[Any, ...]]:
    """Per flat buffer, independent of world size: (dtype, params in layout order, params per bucket)."""
    return [
        (str(s.buffer.dtype), tuple(view.param_index[k]), tuple(len(b.params) for b in s.buffer.layout.buckets))
        for k, s in enumerate(view.shards)
    ]


def _saves_master(shard: LocalShard) -> bool:
    """Whether checkpoints carry this shard's master: only 16-bit params have one that differs from
    the params (an fp32 master kept in host memory by offload equals them), so the formats do not
    depend on where the master lives."""
    return shard.has_master and shard.buffer.dtype.itemsize < 4


def _param_names(view: CheckpointView) -> list[str]:
    return [f"param_groups[{g}]['params'][{j}]" for g, params in enumerate(view.group_params) for j in range(len(params))]


# -- sharded format ----------------------------------------------------------------------------


def _local_range(view: CheckpointView, k: int, b: int) -> tuple[int, int]:
    """This rank's ``[start, end)`` within bucket ``b`` of shard ``k``, padding excluded (``torch.chunk`` split)."""
    bucket = view.shards[k].buffer.layout.buckets[b]
    size = bucket.shard_numel(view.world_size)
    start = min(view.rank * size, bucket.numel)
    return start, min(start + size, bucket.numel)


def _bucket_pieces(view: CheckpointView, k: int, b: int):
    """(piece, virtual param, offset of the piece in this rank's local range of the bucket)."""
    shard = view.shards[k]
    bucket = shard.buffer.layout.buckets[b]
    start = bucket.offset + _local_range(view, k, b)[0]
    for piece, vparam in zip(shard.pieces, shard.virtual_params):
        if bucket.offset <= piece.flat_offset < bucket.offset + bucket.padded_numel:
            yield piece, vparam, piece.flat_offset - start


def _dtensor(view: CheckpointView, local: Tensor, numel: int) -> DTensor:
    placements = [Shard(0)] if view.mesh.ndim == 1 else [Replicate(), Shard(0)]
    return DTensor.from_local(local, view.mesh, placements, run_check=False, shape=torch.Size([numel]), stride=(1,))


def sharded_state_dict(view: CheckpointView) -> dict[str, Any]:
    """This rank's shard as DTensors (see the module docstring). Copies; runs no collective."""
    dtype = view.shards[0].grad_shard.dtype
    keys, _ = state_keys(view.optimizer, dtype)
    buckets: dict[str, dict[str, DTensor]] = {}
    for k, shard in enumerate(view.shards):
        for bucket in shard.buffer.layout.buckets:
            lo, hi = _local_range(view, k, bucket.index)
            entry = {}
            for key in keys:
                local = torch.zeros(hi - lo, dtype=shard.grad_shard.dtype, device=shard.buffer.device)
                for piece, vparam, offset in _bucket_pieces(view, k, bucket.index):
                    value = view.optimizer.state.get(vparam, {}).get(key)
                    if value is not None:
                        local[offset : offset + piece.numel] = value.reshape(-1)
                entry[key] = _dtensor(view, local, bucket.numel)
            if _saves_master(shard):  # this rank's slice starts the bucket's part of the master shard
                start = bucket.shard_offset
                entry["master"] = _dtensor(view, shard.master_view(start, hi - lo).to(shard.buffer.device, copy=True), bucket.numel)
            buckets[f"{k}.{bucket.index}"] = entry
    return {
        "zeroshard": {
            "format": SHARDED_FORMAT, "version": FORMAT_VERSION, "layout": layout_signature(view), "state_keys": keys,
            "rank": view.rank, "world_size": view.world_size,
            "loss_scaler": view.loss_scaler.state_dict() if view.loss_scaler is not None else None,
        },
        "param_groups": _groups_without_params(view.optimizer, view.group_params),
        "param_steps": torch.tensor(view.param_steps, dtype=torch.int64),
        "buckets": buckets,
    }


def _check_sharded(view: CheckpointView, state_dict: dict[str, Any], keys: list[str], filled_in_place: bool) -> None:
    meta = state_dict["zeroshard"]
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"state_dict has zeroshard format version {meta.get('version')!r}; this version reads {FORMAT_VERSION}")
    # DCP fills the DTensors this rank handed out and overwrites plain entries such as the
    # saver's rank with one rank's copy, so the saver's coordinates only mean something when the
    # DTensors came from elsewhere (torch.load of a file saved by one rank).
    if not filled_in_place and (meta.get("rank"), meta.get("world_size")) != (view.rank, view.world_size):
        raise ValueError(
            f"state_dict is the shard of rank {meta.get('rank')} of {meta.get('world_size')}, this is rank {view.rank} of "
            f"{view.world_size}: load each rank's own shard, or reshard with torch.distributed.checkpoint (dcp.load)"
        )
    theirs, ours = [tuple(tuple(x) if isinstance(x, list) else x for x in entry) for entry in meta.get("layout", [])], layout_signature(view)
    if theirs != ours:
        for k, (a, b) in enumerate(zip(theirs, ours)):
            if a != b:
                raise ValueError(f"state_dict flat buffer {k} has (dtype, params, params per bucket) {a}, this optimizer {b}: saved for another model, param groups or bucket_size_mb")
        raise ValueError(f"state_dict has {len(theirs)} flat buffers, this optimizer {len(ours)}: saved for another model")
    if list(meta.get("state_keys", [])) != keys:
        raise ValueError(f"state_dict holds optimizer state {meta.get('state_keys')}, {type(view.optimizer).__name__} keeps {keys}")
    for k, shard in enumerate(view.shards):
        for bucket in shard.buffer.layout.buckets:
            entry = state_dict["buckets"].get(f"{k}.{bucket.index}")
            wanted = keys + (["master"] if _saves_master(shard) else [])
            if entry is None or sorted(entry) != sorted(wanted):
                raise ValueError(f"state_dict bucket {k}.{bucket.index} holds {None if entry is None else sorted(entry)}, expected {sorted(wanted)}")
            lo, hi = _local_range(view, k, bucket.index)
            for key, value in entry.items():
                local = value.to_local() if isinstance(value, DTensor) else value
                if tuple(value.shape) != (bucket.numel,) or local.numel() != hi - lo:
                    raise ValueError(
                        f"state_dict bucket {k}.{bucket.index} {key!r} has shape {tuple(value.shape)} with {local.numel()} local elements; "
                        f"this rank expects ({bucket.numel},) with {hi - lo}: a sharded state dict saved at another world size loads through "
                        "torch.distributed.checkpoint (dcp.load), which reshards it"
                    )


def load_sharded(view: CheckpointView, state_dict: dict[str, Any], filled_in_place: bool) -> tuple[dict[str, Any], list[int], list[tuple[int, int, Tensor]]]:
    """Check a sharded state dict and turn it into (wrapped optimizer state dict, param steps,
    master values as (shard, offset in its master shard, 1-D values)).

    ``filled_in_place``: the DTensors are the ones this rank's last ``state_dict()`` returned
    (``dcp.load`` filled them for this rank). Nothing is written here; the caller applies the result.

    Raises:
        ValueError: another format version, another rank's shard, layout, optimizer state or local
            shard geometry.
    """
    keys, has_step = state_keys(view.optimizer, view.shards[0].grad_shard.dtype)
    _check_sharded(view, state_dict, keys, filled_in_place)
    steps = [int(s) for s in state_dict["param_steps"].tolist()]
    if len(steps) != len(view.param_steps):
        raise ValueError(f"state_dict has steps for {len(steps)} params, this optimizer has {len(view.param_steps)}")
    state: dict[Tensor, dict[str, Any]] = {}
    masters = []
    for k, shard in enumerate(view.shards):
        for bucket in shard.buffer.layout.buckets:
            entry = {key: (v.to_local() if isinstance(v, DTensor) else v) for key, v in state_dict["buckets"][f"{k}.{bucket.index}"].items()}
            for piece, vparam, offset in _bucket_pieces(view, k, bucket.index):
                step = steps[view.param_index[k][piece.param]]
                if step:
                    state[vparam] = {key: entry[key][offset : offset + piece.numel].clone() for key in keys}
                    if has_step:
                        state[vparam]["step"] = torch.tensor(float(step))
            if "master" in entry:
                masters.append((k, bucket.shard_offset, entry["master"]))
    return _inner_state_dict(view, state, state_dict["param_groups"]), steps, masters


def _inner_state_dict(view: CheckpointView, state: dict[Tensor, dict[str, Any]], saved_groups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The wrapped optimizer's ``state_dict`` format over its virtual params, with the saved hyperparameters."""
    if len(saved_groups) != len(view.optimizer.param_groups):
        raise ValueError(f"state_dict has {len(saved_groups)} param groups, this optimizer {len(view.optimizer.param_groups)}")
    index_of, groups = {}, []
    for group, saved in zip(view.optimizer.param_groups, saved_groups):
        ids = []
        for vparam in group["params"]:
            index_of[vparam] = len(index_of)
            ids.append(index_of[vparam])
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    return {"state": {index_of[v]: s for v, s in state.items()}, "param_groups": groups}


# -- full format -------------------------------------------------------------------------------


def consolidate(view: CheckpointView, to: int) -> dict[str, Any] | None:
    """Gather the full state onto global rank ``to`` one bucket at a time; the full dict there, else ``None``.

    A collective over ``to``'s shard group (other shard groups, replicas of it, return at once).
    Ranks other than ``to`` never hold more than their own slice of one bucket.
    """
    if to not in dist.get_process_group_ranks(view.shard_group):
        return None
    dtype = view.shards[0].grad_shard.dtype
    keys, has_step = state_keys(view.optimizer, dtype)
    here = dist.get_rank() == to
    flat_params = [p for params in view.group_params for p in params]
    state: dict[int, dict[str, Any]] = {i: {"step": torch.tensor(float(s))} if has_step else {} for i, s in enumerate(view.param_steps) if s}
    masters: dict[int, Tensor] = {}
    for k, shard in enumerate(view.shards):
        layout = shard.buffer.layout
        for bucket in layout.buckets:
            size = bucket.shard_numel(view.world_size)
            for key in keys + (["master"] if _saves_master(shard) else []):
                local = torch.zeros(size, dtype=dtype, device=shard.buffer.device)
                if key == "master":
                    local.copy_(shard.master_slice(bucket.index))
                else:
                    for piece, vparam, offset in _bucket_pieces(view, k, bucket.index):
                        value = view.optimizer.state.get(vparam, {}).get(key)
                        if value is not None:
                            local[offset : offset + piece.numel] = value.reshape(-1)
                pieces = [torch.empty_like(local) for _ in range(view.world_size)] if here else None
                dist.gather(local, pieces, dst=to, group=view.shard_group)
                if not here:
                    continue
                full = torch.cat(pieces)
                for i in bucket.params:
                    slot = layout.slots[i]
                    index = view.param_index[k][i]
                    value = full[slot.offset - bucket.offset : slot.offset - bucket.offset + slot.numel].clone().view(flat_params[index].shape)
                    if key == "master":
                        masters[index] = value
                    elif index in state:
                        state[index][key] = value
    if not here:
        return None
    return {
        "state": state,
        "param_groups": _groups_without_params(view.optimizer, view.group_params),
        "zeroshard": {
            "format": FULL_FORMAT,
            "version": FORMAT_VERSION,
            "params": [(tuple(p.shape), str(p.dtype)) for p in flat_params],
            "master": masters,
            "loss_scaler": view.loss_scaler.state_dict() if view.loss_scaler is not None else None,
        },
    }


def load_full(view: CheckpointView, state_dict: dict[str, Any]) -> tuple[dict[str, Any], list[int], list[tuple[int, int, Tensor]]]:
    """Check a full ``torch.optim``-format state dict and cut this rank's shard out of it.

    Accepts dicts from :func:`consolidate` and from a plain unsharded ``torch.optim`` optimizer
    of the same class over the same params. Nothing is written here.

    Raises:
        ValueError: another group count, param count, param shape or dtype (named), or state
            keys this optimizer does not keep.
    """
    if not isinstance(state_dict.get("state"), dict) or not isinstance(state_dict.get("param_groups"), list):
        raise ValueError("state_dict has no 'state' dict and 'param_groups' list: neither a zeroshard nor a torch.optim state dict")
    names = _param_names(view)
    flat_params = [p for params in view.group_params for p in params]
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(view.group_params):
        raise ValueError(f"state_dict has {len(saved_groups)} param groups, this optimizer {len(view.group_params)}")
    for g, (saved, params) in enumerate(zip(saved_groups, view.group_params)):
        if len(saved["params"]) != len(params):
            raise ValueError(f"state_dict param_groups[{g}] has {len(saved['params'])} params, this optimizer {len(params)}")
    order = [i for saved in saved_groups for i in saved["params"]]  # saved index of each of our params
    meta = state_dict.get("zeroshard") or {}
    for ours, (saved_index, p) in enumerate(zip(order, flat_params)):
        if meta.get("params"):
            shape, dtype = meta["params"][saved_index]
            if (tuple(shape), dtype) != (tuple(p.shape), str(p.dtype)):
                raise ValueError(f"{names[ours]} was saved with shape {tuple(shape)} and {dtype}, this model has {tuple(p.shape)} and {p.dtype}")
    keys, has_step = state_keys(view.optimizer, view.shards[0].grad_shard.dtype)
    steps = [0] * len(flat_params)
    for ours, saved_index in enumerate(order):
        entry = state_dict["state"].get(saved_index)
        if not entry:
            continue
        if sorted(k for k in entry if k != "step") != keys:
            raise ValueError(f"state_dict state of {names[ours]} has {sorted(entry)}, {type(view.optimizer).__name__} keeps {keys + (['step'] if has_step else [])}")
        for key in keys:
            if tuple(entry[key].shape) != tuple(flat_params[ours].shape):
                raise ValueError(f"state_dict {key!r} of {names[ours]} has shape {tuple(entry[key].shape)}, the param {tuple(flat_params[ours].shape)}")
        steps[ours] = int(float(entry["step"])) if "step" in entry else 1
    state: dict[Tensor, dict[str, Any]] = {}
    masters = []
    saved_masters = meta.get("master") or {}
    for k, shard in enumerate(view.shards):
        for piece, vparam in zip(shard.pieces, shard.virtual_params):
            ours = view.param_index[k][piece.param]
            entry = state_dict["state"].get(order[ours])
            if steps[ours]:
                state[vparam] = {key: entry[key].reshape(-1)[piece.param_offset : piece.param_offset + piece.numel].clone() for key in keys}
                if has_step:
                    state[vparam]["step"] = torch.tensor(float(steps[ours]))
            master = saved_masters.get(order[ours])
            if _saves_master(shard) and master is not None:
                masters.append((k, piece.shard_offset, master.reshape(-1)[piece.param_offset : piece.param_offset + piece.numel]))
    return _inner_state_dict(view, state, saved_groups), steps, masters


def bucket_tensors(state_dict: dict[str, Any]) -> list[Any]:
    """The DTensors of a sharded state dict."""
    return [v for entry in state_dict.get("buckets", {}).values() for v in entry.values()]
