"""The sharded (DCP) checkpoint format of ``partition="flat"``, and what all formats share (``docs/checkpoint.md``).

Bucket boundaries depend on the params and ``bucket_size_mb`` only, and ``DTensor``'s ``Shard(0)`` splits a bucket like
``torch.chunk`` (``ceil(n/N)`` per rank), as zeroshard slices it: every rank's slice is its local shard, and
``torch.distributed.checkpoint`` reshards it onto any world size. The hyperparameters saved with a checkpoint win on load
(as in ``torch.optim``): its state is checked against what they keep (:func:`state_keys`).
The buffers are those of [Note: zeroshard buffers] in ``zeroshard/layout/flat_buffer.py``.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from zeroshard.layout.flat_buffer import param_name
from zeroshard.layout.local_shard import LocalShard
from zeroshard.step.loss_scaler import DynamicLossScaler
from zeroshard.step.wrapped import state_keys

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor, Replicate, Shard

SHARDED_FORMAT = "zeroshard.sharded"
FULL_FORMAT = "zeroshard.full"
# 2: the layout signature names each param (``param_groups[g]['params'][j]``) with its shape, and
# ``state_keys`` is per param group. Version 1 recorded param indices only.
# 3: flat buckets start each param on a 64-byte boundary (``param_align``); 2 loads where its buckets are 3's.
SHARDED_FORMAT_VERSION = 3
FULL_FORMAT_VERSION = 1
# What a load hands the optimizer: the wrapped optimizer's state dict, the per-param step counts, and the masters to
# copy as (shard, offset in its master shard, 1-D values).
Loaded = tuple[dict[str, Any], list[int], list[tuple[int, int, Tensor]]]


@dataclass
class CheckpointView:
    """What the checkpoint code reads and writes of a ``ShardedOptimizer``."""

    optimizer: torch.optim.Optimizer  # the wrapped optimizer (its params are the virtual parameters)
    shards: list[LocalShard]  # in flat-buffer order; each knows its param group and its params' torch.optim indices
    group_params: list[list[nn.Parameter]]  # per param group, the user's params in order (frozen ones included)
    param_steps: list[int]  # per param (torch.optim numbering): how many updates it has had; replicated
    mesh: DeviceMesh  # the DTensors' mesh (1-D shard, or 2-D replicate x shard)
    shard_group: dist.ProcessGroup  # the ranks that share one copy of the state
    partition: str = "flat"  # ShardedOptimizer.partition: "flat" or "param" (each param owned whole)
    loss_scaler: DynamicLossScaler | None = None  # its state travels in both formats
    timeout: datetime.timedelta | None = None  # collective_timeout_s: the bound on a consolidation's collectives

    @property
    def rank(self) -> int:
        return dist.get_rank(self.shard_group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.shard_group)

    @property
    def scaler_state(self) -> dict[str, Any] | None:
        return self.loss_scaler.state_dict() if self.loss_scaler is not None else None

    @cached_property
    def flat_params(self) -> list[nn.Parameter]:
        """The user's params in ``torch.optim`` order."""
        return [p for params in self.group_params for p in params]


def group_state_keys(view: CheckpointView, groups: Sequence[dict[str, Any]]) -> list[tuple[list[str], bool]]:
    """:func:`state_keys` for each of ``groups`` (the live param groups, or a checkpoint's)."""
    return [state_keys(view.optimizer, group, view.shards[0].master_dtype, view.shards[0].buffer.device) for group in groups]


def groups_without_params(optimizer: torch.optim.Optimizer, group_params: list[list[nn.Parameter]]) -> list[dict[str, Any]]:
    """Each group's hyperparameters, with ``"params"`` as ``torch.optim`` numbers them."""
    groups, start = [], 0
    for group, params in zip(optimizer.param_groups, group_params):
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + len(params)))})
        start += len(params)
    return groups


def layout_signature(view: CheckpointView) -> list[tuple[Any, ...]]:
    """Per flat buffer, independent of world size: (dtype, (name, shape) of each param in layout order, params per
    bucket, or ``"whole params"`` for ``partition="param"``); a param is named ``param_groups[g]['params'][j]``."""
    names = param_names(view)
    return [
        (
            str(s.buffer.dtype),
            tuple((names[i], tuple(view.flat_params[i].shape)) for i in s.param_indices),
            # whole params: the buckets depend on the world size, and the format does not use them
            "whole params" if s.buffer.layout.whole_params else tuple(len(b.params) for b in s.buffer.layout.buckets),
        )
        for s in view.shards
    ]


def _as_tuples(value: Any) -> Any:
    """``value`` with every list turned into a tuple, recursively (a signature as saved, made comparable)."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def check_layout(view: CheckpointView, saved_layout: Any) -> None:
    """Raise ``ValueError`` unless a sharded checkpoint's ``layout`` entry matches this optimizer, naming every param saved
    with another shape (both shapes), or else what differs."""
    theirs, ours = _as_tuples(saved_layout), _as_tuples(layout_signature(view))
    if theirs == ours:
        return
    saved = {name: shape for _, params, _ in theirs for name, shape in params}
    here = {name: shape for _, params, _ in ours for name, shape in params}
    if saved != here and sorted(saved.values()) == sorted(here.values()):  # the same shapes in other places: not a reshaped param
        name = next((n for n, shape in here.items() if saved.get(n, shape) != shape), None) or next(n for n in here if n not in saved)
        raise ValueError(f"state_dict has params of this model's shapes, but in other places of param_groups ({name}: saved "
                         f"{saved.get(name, 'with no param there')}, this model {here[name]}): saved with other param groups, or the params in another order")
    if len(saved) != len(here):  # not a reshaped param either: the params after it moved up or down
        hint = " (unfrozen in the saved run: unfreeze it before the load)" if saved.keys() - here.keys() else ""
        raise ValueError(f"state_dict has optimizer state for {len(saved)} params, this optimizer trains {len(here)}: a param added, removed "
                         f"or frozen since the save{hint}, or another model (saved only: {sorted(saved.keys() - here.keys())}; here only: "
                         f"{sorted(here.keys() - saved.keys())})")
    reshaped = [f"{name} was saved with shape {saved[name]}, this model has {shape}" for name, shape in here.items() if name in saved and saved[name] != shape]
    if reshaped:
        raise ValueError("; ".join(reshaped))
    if saved.keys() != here.keys():
        raise ValueError(f"state_dict has optimizer state for {sorted(saved.keys() - here.keys())} that this optimizer does not train, and none for "
                         f"{sorted(here.keys() - saved.keys())}: saved for another model, param groups or frozen params")
    if sorted(theirs, key=repr) == sorted(ours, key=repr):
        raise ValueError("state_dict has this optimizer's flat buffers in another order: params unfrozen and groups added in another "
                         "order than when saved; repeat its calls in their order")
    for k, (a, b) in enumerate(zip(theirs, ours)):
        if a[0] != b[0]:
            raise ValueError(f"state_dict flat buffer {k} holds {a[0]} params, this optimizer's are {b[0]}: saved with the model in another dtype")
        if a != b and a[1] == b[1]:
            raise ValueError(f"state_dict flat buffer {k} has {a[2]} params per bucket, this optimizer {b[2]}: saved with another bucket_size_mb")
        if a != b:
            raise ValueError(f"state_dict flat buffer {k} has (dtype, params, params per bucket) {a}, this optimizer {b}: "
                             "saved for another model, param groups or bucket_size_mb")
    raise ValueError(f"state_dict has {len(theirs)} flat buffers, this optimizer {len(ours)}: saved for another model")


def master_hint(found: Any, wanted: Any) -> str:
    """A sentence for a load whose state keys ``found`` (``None``: no entry) differ from the expected ``wanted`` by ``"master"``
    alone (``master_weights`` changed), else ``""``."""
    if found is None or set(found) ^ set(wanted) != {"master"}:
        return ""
    saved = "master" in found
    return (f" The checkpoint was saved with master_weights={saved} (fp32 masters of 16-bit params {'kept' if saved else 'not kept'}): "
            f"build the optimizer with master_weights={saved}, or load the full format, which converts.")


def saves_master(shard: LocalShard) -> bool:
    """Whether checkpoints carry this shard's master: only 16-bit params have one that differs from the params (offload's
    fp32 host master equals them), so the formats do not depend on where the master lives."""
    return shard.has_master and shard.buffer.dtype.itemsize < 4


def param_names(view: CheckpointView) -> list[str]:
    """Each param's name, ``param_groups[g]['params'][j]``, in ``torch.optim`` order."""
    return [param_name(g, j) for g, params in enumerate(view.group_params) for j in range(len(params))]


# -- sharded format ----------------------------------------------------------------------------


def _local_range(view: CheckpointView, k: int, b: int) -> tuple[int, int]:
    """This rank's ``[start, end)`` within bucket ``b`` of shard ``k``, padding excluded (``torch.chunk`` split)."""
    bucket = view.shards[k].buffer.layout.buckets[b]
    size = bucket.shard_numel(view.world_size)
    start = min(view.rank * size, bucket.numel)
    return start, min(start + size, bucket.numel)


def bucket_pieces(view: CheckpointView, k: int, b: int):
    """(piece, virtual param, offset of the piece in this rank's local range of the bucket)."""
    shard = view.shards[k]
    bucket = shard.buffer.layout.buckets[b]
    start = bucket.offset + _local_range(view, k, b)[0]
    for piece, vparam in zip(shard.pieces, shard.virtual_params):
        if bucket.offset <= piece.flat_offset < bucket.offset + bucket.padded_numel:
            yield piece, vparam, piece.flat_offset - start


def local_state(view: CheckpointView, k: int, b: int, key: str, numel: int) -> Tensor:
    """1-D, shard ``k``'s master dtype, ``numel`` elements: state ``key`` of this rank's part of
    bucket ``b`` (from its local range's start), zero where no piece holds it (padding, params never stepped)."""
    shard = view.shards[k]
    local = torch.zeros(numel, dtype=shard.master_dtype, device=shard.buffer.device)
    for piece, vparam, offset in bucket_pieces(view, k, b):
        value = view.optimizer.state.get(vparam, {}).get(key)
        if value is not None:
            local[offset : offset + piece.numel] = value.reshape(-1)
    return local


def _dtensor_api() -> tuple[type[DTensor], type[Replicate], type[Shard]]:
    """``DTensor`` and its placements, imported on first use: ``torch.distributed.tensor`` imports
    sympy (a third of a second), which ``import zeroshard`` must not pay for."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor, Replicate, Shard


def _dtensor(view: CheckpointView, local: Tensor, numel: int) -> DTensor:
    dtensor, replicate, shard = _dtensor_api()
    placements = [shard(0)] if view.mesh.ndim == 1 else [replicate(), shard(0)]
    return dtensor.from_local(local, view.mesh, placements, run_check=False, shape=torch.Size([numel]), stride=(1,))


def consolidation_marker(mesh: DeviceMesh) -> DTensor:
    """A DTensor with one element on each rank of ``mesh`` (sharded over every mesh dim, so no replica covers another's).

    The sharded ``state_dict()`` carries it from a ``consolidate_state_dict()`` to the next step: then the rank that took
    the full format leaves its element out, and ``dcp.save`` refuses the checkpoint on every rank (a global plan whose
    chunks do not fill a tensor) instead of writing one that lacks that rank's shard.
    """
    dtensor, _, shard = _dtensor_api()
    local = torch.zeros(1, device=mesh.device_type)
    return dtensor.from_local(local, mesh, [shard(0)] * mesh.ndim, run_check=False, shape=torch.Size([mesh.size()]), stride=(1,))


def _to_local(value: Any) -> Any:
    """A ``DTensor``'s local shard (what ``dcp.load`` filled in for this rank); any other value as is."""
    return value.to_local() if isinstance(value, _dtensor_api()[0]) else value


def sharded_state_dict(view: CheckpointView) -> dict[str, Any]:
    """This rank's shard: per bucket, a 1-D DTensor of each state and the master (``docs/checkpoint.md``). Copies; runs no collective."""
    group_keys = group_state_keys(view, view.optimizer.param_groups)
    buckets: dict[str, dict[str, DTensor]] = {}
    for k, shard in enumerate(view.shards):
        keys, _ = group_keys[shard.group]
        for bucket in shard.buffer.layout.buckets:
            lo, hi = _local_range(view, k, bucket.index)
            entry = {key: _dtensor(view, local_state(view, k, bucket.index, key, hi - lo), bucket.numel) for key in keys}
            if saves_master(shard):  # this rank's slice starts the bucket's part of the master shard
                entry["master"] = _dtensor(view, shard.master_view(bucket.shard_offset, hi - lo).to(shard.buffer.device, copy=True), bucket.numel)
            buckets[f"{k}.{bucket.index}"] = entry
    # No entry may be added to it without a new format version: dcp.load asks the checkpoint for every entry of this template.
    return sharded_envelope(view, {"state_keys": [keys for keys, _ in group_keys]}, shapes=param_shapes(view), buckets=buckets)


def sharded_envelope(view: CheckpointView, meta: dict[str, Any], shapes: dict[str, Tensor] | None = None, **entries: Any) -> dict[str, Any]:
    """Both partitions' sharded format around ``entries``: the ``"zeroshard"`` entry (with ``meta``), the flat partition's
    :func:`param_shapes` (first, so that ``dcp.load`` names a param added, removed or reshaped), param groups and steps."""
    return {
        "zeroshard": {"format": SHARDED_FORMAT, "version": SHARDED_FORMAT_VERSION, "partition": view.partition, "layout": layout_signature(view),
                      "rank": view.rank, "world_size": view.world_size, "loss_scaler": view.scaler_state, **meta},
        **({"shapes": shapes} if shapes is not None else {}),
        "param_groups": groups_without_params(view.optimizer, view.group_params),
        "param_steps": torch.tensor(view.param_steps, dtype=torch.int64),
        **entries,
    }


def param_shapes(view: CheckpointView) -> dict[str, Tensor]:
    """Per sharded param, by name, an empty tensor of shape ``(0, *param.shape)``: its shape in DCP's metadata, free on disk.
    ``dcp.load`` checks every entry's size in the state dict's order before it reads anything, and these come before the
    buckets, so a param saved with another shape fails here, named with both shapes (``docs/checkpoint.md``, What is checked)."""
    return {name: torch.empty((0, *param.shape)) for shard in view.shards for name, param in zip(shard.buffer.names, shard.buffer.params)}


def packed(view: CheckpointView) -> bool:
    """Whether every bucket holds what format version 2's did (:meth:`FlatParamBuffer.packed`)."""
    return all(s.buffer.packed() for s in view.shards)


def _check_version(meta: dict[str, Any], packed: bool = True) -> None:
    """Raise ``ValueError`` unless a sharded checkpoint of ``meta``'s version loads: this one, or 2 where the buckets are
    ``packed`` or with ``partition="param"`` (the converter reads every 2)."""
    version = meta.get("version")
    if version == 2 and not packed and meta.get("partition", "flat") == "flat":
        raise ValueError("state_dict is a sharded zeroshard checkpoint of format version 2, whose buckets hold the params packed end to end; "
                         f"format {SHARDED_FORMAT_VERSION} starts each param on a 64-byte boundary, which moves some of this model's params. "
                         "A DCP checkpoint: python -m zeroshard.convert CHECKPOINT OUT writes the full format (torch.load(OUT)[key]), which "
                         "loads here at any world size; a per-rank file: load it with the zeroshard that saved it, and save the full format")
    if version == 1:
        raise ValueError("state_dict is a sharded zeroshard checkpoint of format version 1, whose layout signature does not record param shapes; "
                         f"this version reads version {SHARDED_FORMAT_VERSION}. Load it with the "
                         "zeroshard version that saved it, call consolidate_state_dict(to=0) and save the full format, which loads here at any world size")
    if version not in (2, SHARDED_FORMAT_VERSION):
        raise ValueError(f"state_dict has zeroshard sharded format version {version!r}; this version reads 2 and {SHARDED_FORMAT_VERSION}")


def check_meta(view: CheckpointView, meta: dict[str, Any], filled_in_place: bool) -> None:
    """Raise ``ValueError`` unless a sharded checkpoint's ``meta`` has this format version, was saved with this ``partition`` (else
    naming the way out: the full format), unless ``filled_in_place`` by this rank at this world size (DCP overwrites plain
    entries such as the saver's rank with one rank's copy, so they only mean something in a file saved by one rank), and
    with this layout (:func:`check_layout`)."""
    _check_version(meta, packed(view))
    saved, partition = meta.get("partition", "flat"), view.partition  # checkpoints from before partition="param" are flat
    if saved != partition:
        raise ValueError(f"state_dict is a sharded checkpoint of partition={saved!r}, this optimizer has partition={partition!r}: call "
                         "consolidate_state_dict(to=0) where it was saved and load that full torch.optim-format state dict, which loads in either mode")
    if not filled_in_place and (meta.get("rank"), meta.get("world_size")) != (view.rank, view.world_size):
        raise ValueError(f"state_dict is the shard of rank {meta.get('rank')} of {meta.get('world_size')}, this is rank {view.rank} of "
                         f"{view.world_size}: load each rank's own shard, or reshard with torch.distributed.checkpoint (dcp.load). A file saved from "
                         "one rank's optimizer.state_dict() (HF Trainer's optimizer.pt, accelerate's save_state) holds that rank's shard "
                         "unless every rank called consolidate_state_dict(to=0) before the save (docs/integrations.md)")
    check_layout(view, meta.get("layout", []))


def check_envelope(view: CheckpointView, state_dict: dict[str, Any], filled_in_place: bool) -> tuple[list[dict[str, Any]], list[int]]:
    """:func:`check_meta`, then the saved param groups and per-param steps (returned) against this optimizer's."""
    check_meta(view, state_dict["zeroshard"], filled_in_place)
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(view.optimizer.param_groups):
        raise ValueError(f"state_dict has {len(saved_groups)} param groups, this optimizer {len(view.optimizer.param_groups)}")
    steps = [int(s) for s in state_dict["param_steps"].tolist()]
    if len(steps) != len(view.param_steps):
        raise ValueError(f"state_dict has steps for {len(steps)} params, this optimizer has {len(view.param_steps)}")
    return saved_groups, steps


def check_state_keys(view: CheckpointView, meta: dict[str, Any], group_keys: list[tuple[list[str], bool]], whose: str) -> None:
    """Raise ``ValueError`` unless ``meta`` saved the state keys ``group_keys`` holds, per param group."""
    saved_keys = [list(keys) for keys in meta.get("state_keys", [])]
    if saved_keys != [keys for keys, _ in group_keys]:
        raise ValueError(f"state_dict holds optimizer state {saved_keys} per param group; {type(view.optimizer).__name__} with {whose} "
                         f"keeps {[keys for keys, _ in group_keys]}")


def load_sharded(view: CheckpointView, state_dict: dict[str, Any], filled_in_place: bool) -> Loaded:
    """Check a sharded state dict and turn it into what a load hands the optimizer (:data:`Loaded`); writes nothing.

    ``filled_in_place``: the DTensors are those this rank's last ``state_dict()`` returned (``dcp.load`` filled them).

    Raises:
        ValueError: another format version (version 1, saved before the layout named params, with a way out), another rank's
            shard, a param saved with another shape (named, with both shapes), another layout, optimizer state that the
            saved hyperparameters do not keep, or local shard geometry.
    """
    saved_groups, steps = check_envelope(view, state_dict, filled_in_place)
    group_keys = group_state_keys(view, saved_groups)
    check_state_keys(view, state_dict["zeroshard"], group_keys, "the state_dict's hyperparameters")
    state: dict[Tensor, dict[str, Any]] = {}
    masters = []
    for k, shard in enumerate(view.shards):
        keys, has_step = group_keys[shard.group]
        for bucket in shard.buffer.layout.buckets:
            saved = state_dict["buckets"].get(f"{k}.{bucket.index}")
            wanted = keys + (["master"] if saves_master(shard) else [])
            if saved is None or sorted(saved) != sorted(wanted):
                found = None if saved is None else sorted(saved)
                if filled_in_place:
                    raise ValueError(f"the checkpoint holds optimizer state {sorted(wanted)} for bucket {k}.{bucket.index}, but this optimizer's "
                                     f"state_dict() gave dcp.load {found} to fill: its hyperparameters keep other state than the checkpoint's. "
                                     "Build the optimizer with the checkpoint's hyperparameters, or load a full or per-rank state dict")
                raise ValueError(f"state_dict bucket {k}.{bucket.index} holds {found}, expected {sorted(wanted)}.{master_hint(found, wanted)}")
            lo, hi = _local_range(view, k, bucket.index)
            entry = {key: _to_local(value) for key, value in saved.items()}
            for key, value in saved.items():
                if tuple(value.shape) != (bucket.numel,) or entry[key].numel() != hi - lo:
                    raise ValueError(f"state_dict bucket {k}.{bucket.index} {key!r} has shape {tuple(value.shape)} with {entry[key].numel()} local "
                                     f"elements; this rank expects ({bucket.numel},) with {hi - lo}: a sharded state dict saved at another world size "
                                     "loads through torch.distributed.checkpoint (dcp.load), which reshards it")
            for piece, vparam, offset in bucket_pieces(view, k, bucket.index):
                step = steps[shard.param_indices[piece.param]]
                if step:
                    state[vparam] = {key: entry[key][offset : offset + piece.numel].clone() for key in keys}
                    if has_step:
                        state[vparam]["step"] = torch.tensor(float(step))
            if "master" in entry:
                masters.append((k, bucket.shard_offset, entry["master"]))
    return inner_state_dict(view, state, saved_groups), steps, masters


def inner_state_dict(view: CheckpointView, state: dict[Tensor, dict[str, Any]], saved_groups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The wrapped optimizer's ``state_dict`` format over its virtual params, with the saved
    hyperparameters (the caller has checked that there are as many groups)."""
    index_of = {vparam: i for i, vparam in enumerate(p for group in view.optimizer.param_groups for p in group["params"])}
    groups = [{**{k: v for k, v in saved.items() if k != "params"}, "params": [index_of[p] for p in group["params"]]}
              for group, saved in zip(view.optimizer.param_groups, saved_groups)]
    return {"state": {index_of[v]: s for v, s in state.items()}, "param_groups": groups}


def issued_tensors(state_dict: dict[str, Any]) -> list[Any]:
    """The tensors of a sharded state dict that ``dcp.load`` fills in place: the param steps and every bucket DTensor, or
    with ``partition="param"`` every tensor of this rank's params (none for SGD without momentum, which keeps no state)."""
    steps = state_dict.get("param_steps")
    entries = [*state_dict.get("buckets", {}).values(), *state_dict.get("params", {}).values()]
    return ([steps] if torch.is_tensor(steps) else []) + [v for entry in entries for v in entry.values()]
