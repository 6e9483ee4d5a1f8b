"""The full checkpoint format: the whole state gathered onto one rank, plain ``torch.optim`` (see ``sharded.py``); its
consolidation for ``partition="flat"`` (``whole_param.py`` has that of ``partition="param"``), its load for both."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from zeroshard.checkpoint.sharded import (
    FULL_FORMAT,
    FULL_FORMAT_VERSION,
    CheckpointView,
    Loaded,
    group_state_keys,
    groups_without_params,
    inner_state_dict,
    local_state,
    param_names,
    saves_master,
)
from zeroshard.comm import collectives
from zeroshard.step.wrapped import StateSpec, copy_state_value, state_spec


def consolidate(view: CheckpointView, to: int) -> dict[str, Any] | None:
    """Gather the full state onto global rank ``to`` one bucket at a time; the full dict there, else ``None``.

    A collective over ``to``'s shard group (other shard groups return at once); other ranks never hold more than their slice
    of one bucket. Each value is gathered in its shard's master dtype (fp32 for 16- and 32-bit params, fp64 for fp64 ones;
    the param dtype with ``master_weights=False``), so it arrives unrounded.
    """
    if to not in dist.get_process_group_ranks(view.shard_group):
        return None
    group_keys = group_state_keys(view, view.optimizer.param_groups)
    here = dist.get_rank() == to
    group_of_param = [g for g, params in enumerate(view.group_params) for _ in params]
    state: dict[int, dict[str, Any]] = {i: {"step": torch.tensor(float(s))} if group_keys[group_of_param[i]][1] else {}
                                        for i, s in enumerate(view.param_steps) if s}
    masters: dict[int, Tensor] = {}
    for k, shard in enumerate(view.shards):
        layout = shard.buffer.layout
        keys, _ = group_keys[shard.group]
        for bucket in layout.buckets:
            size = bucket.shard_numel(view.world_size)
            for key in keys + (["master"] if saves_master(shard) else []):
                if key == "master":
                    local = shard.master_slice(bucket.index).to(shard.buffer.device, copy=True)
                else:
                    local = local_state(view, k, bucket.index, key, size)
                pieces: list[Tensor] | None = [local]
                if view.world_size > 1:
                    pieces = [torch.empty_like(local) for _ in range(view.world_size)] if here else None
                    collectives.gather(local, pieces, dst=to, group=view.shard_group, timeout=view.timeout)
                if pieces is None:  # not the receiving rank
                    continue
                full = torch.cat(pieces)
                for i in bucket.params:
                    slot, index = layout.slots[i], shard.param_indices[i]
                    start = slot.offset - bucket.offset
                    value = full[start : start + slot.numel].clone().view(view.flat_params[index].shape)
                    if key == "master":
                        masters[index] = value
                    elif index in state:
                        state[index][key] = value
    return full_envelope(view, state, masters) if here else None


def check_full(view: CheckpointView, state_dict: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    """The checks every full state dict passes; returns the saved index of each of our params in ``torch.optim`` order, and
    the ``"zeroshard"`` entry (``{}`` for a plain ``torch.optim`` dict). Raises ``ValueError`` for a non-state dict or another
    group count, param count, shape or dtype, or state for params frozen when this optimizer was built (named)."""
    if not isinstance(state_dict.get("state"), dict) or not isinstance(state_dict.get("param_groups"), list):
        raise ValueError("state_dict has no 'state' dict and 'param_groups' list: neither a zeroshard nor a torch.optim state dict")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(view.group_params):
        raise ValueError(f"state_dict has {len(saved_groups)} param groups, this optimizer {len(view.group_params)}")
    for g, (saved, params) in enumerate(zip(saved_groups, view.group_params)):
        if len(saved["params"]) != len(params):
            raise ValueError(f"state_dict param_groups[{g}] has {len(saved['params'])} params, this optimizer {len(params)}")
    order = [i for saved in saved_groups for i in saved["params"]]  # saved index of each of our params
    meta = state_dict.get("zeroshard") or {}
    if meta.get("params"):  # zeroshard's full dicts record each param's shape and dtype
        recorded = meta["params"]
        if sorted(order) != list(range(len(recorded))) or not all(isinstance(e, (list, tuple)) and len(e) == 2 for e in recorded):
            raise ValueError(f"state_dict's param_groups list {len(order)} param indices and its 'zeroshard' entry records {len(recorded)} "
                             "(shape, dtype) pairs: a zeroshard full state dict lists each index below that count once, and one pair "
                             "per param (a corrupted or edited file?)")
        names = param_names(view)
        for ours, (saved_index, p) in enumerate(zip(order, view.flat_params)):
            shape, dtype = recorded[saved_index]
            if (tuple(shape), dtype) != (tuple(p.shape), str(p.dtype)):
                raise ValueError(f"{names[ours]} was saved with shape {tuple(shape)} and {dtype}, this model has {tuple(p.shape)} and {p.dtype}")
    sharded = {i for shard in view.shards for i in shard.param_indices}
    # A 0-element param is never sharded; the state torch.optim keeps for it (empty moments, a step) is dropped, as nothing reads it.
    frozen = [ours for ours, saved_index in enumerate(order)
              if ours not in sharded and view.flat_params[ours].numel() and state_dict["state"].get(saved_index)]
    if frozen:  # no shard to hold it: dropped, its moments would restart from zero when unfrozen, its step count not
        names = param_names(view)
        raise ValueError(f"state_dict holds optimizer state for {[names[i] for i in frozen]}, frozen (requires_grad=False) when this "
                         "optimizer was built, so not sharded: unfreeze them (before building the ShardedOptimizer or before this load), as "
                         "when the state was saved, or delete their entries from state_dict['state'] to train them from fresh state")
    return order, meta


def full_envelope(view: CheckpointView, state: dict[int, dict[str, Any]], masters: dict[int, Tensor]) -> dict[str, Any]:
    """A full state dict around ``state`` (per ``torch.optim`` index) and the fp32 ``masters`` of 16-bit params."""
    return {
        "state": state,
        "param_groups": groups_without_params(view.optimizer, view.group_params),
        "zeroshard": {"format": FULL_FORMAT, "version": FULL_FORMAT_VERSION, "params": [(tuple(p.shape), str(p.dtype)) for p in view.flat_params],
                      "master": masters, "loss_scaler": view.scaler_state},
    }


def unnested(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` (full format, not modified) with the state ``optimizer``'s own ``state_dict()`` nests put back flat.

    bitsandbytes' 8-bit optimizers (0.45 on) move each entry's quantization state (``state1``, ``absmax1``, ``qmap1``, ...)
    under the key their class attribute ``_FSDP_WRAPPED_QUANT_STATE_KEY`` names (``"__bnb_optimizer_quant_state__"``), so
    FSDP's gather skips it; ``optimizer.state``, their ``load_state_dict`` and zeroshard's formats hold it flat. Other dicts
    come back as they are. Follows bitsandbytes' ``Optimizer8bit.state_dict`` / ``load_state_dict`` (bitsandbytes/optim/optimizer.py)."""
    key = getattr(optimizer, "_FSDP_WRAPPED_QUANT_STATE_KEY", None)
    state = state_dict.get("state")
    if not isinstance(key, str) or not isinstance(state, dict):
        return state_dict
    flat = {index: {**{k: v for k, v in entry.items() if k != key}, **entry[key]}
            if isinstance(entry, dict) and isinstance(entry.get(key), dict) else entry for index, entry in state.items()}
    return {**state_dict, "state": flat}


def load_full(view: CheckpointView, state_dict: dict[str, Any]) -> Loaded:
    """Check a full ``torch.optim``-format state dict and cut this rank's shard out of it (with ``partition="param"``, its params'
    state whole); nothing is written here, and every param's entry is checked on every rank, so a bad dict raises alike everywhere.

    Accepts dicts from a consolidation and from an unsharded ``torch.optim`` optimizer of the same class over the same
    params: each param must hold the state its saved param group's hyperparameters keep. A 16-bit param whose fp32 master
    the dict lacks (a plain ``torch.optim`` dict) gets its current value as master, as in a freshly built optimizer.

    Raises:
        ValueError: as :func:`check_full`, or a param's state with other keys, types or shapes than the saved
            hyperparameters keep (named).
    """
    order, meta = check_full(view, state_dict)
    names, saved_groups, whole = param_names(view), state_dict["param_groups"], view.partition == "param"
    group_keys = [] if whole else group_state_keys(view, saved_groups)
    name = type(view.optimizer).__name__
    specs: dict[int, StateSpec] = {}
    steps = [0] * len(order)
    # In torch.optim's order (the layout's is reversed), so that an error names the first bad param.
    for ours, shard, param in sorted(((s.param_indices[i], s, p) for s in view.shards for i, p in enumerate(s.buffer.params)), key=lambda t: t[0]):
        if not (entry := state_dict["state"].get(order[ours])):
            continue
        if whole:
            try:
                spec = state_spec(view.optimizer, saved_groups[shard.group], param.shape, shard.master_dtype, ("meta", "cpu", param.device))
            except ValueError as error:
                raise ValueError(f"the state_dict's param_groups[{shard.group}] does not build {name} (saved by another optimizer "
                                 f"class?): {error}") from error
        else:  # per-element state, shaped as the param
            keys, has_step = group_keys[shard.group]
            spec = StateSpec(dict.fromkeys(keys, tuple(param.shape)), dict.fromkeys(keys, shard.master_dtype), has_step)
        specs[ours] = spec
        kinds = {key: type(value) for key, value in entry.items() if key in spec.subclasses and type(value) is not spec.subclasses[key].cls}
        if kinds:
            raise ValueError(f"state_dict state of {names[ours]} holds {sorted((k, t.__name__) for k, t in kinds.items())} (key, type) where "
                             f"{name} keeps {sorted((k, sub.cls.__name__) for k, sub in spec.subclasses.items())}")
        found = {key: tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__ for key, value in entry.items() if key != "step"}
        if sorted(entry) != sorted(kept := [*spec.shapes, *(["step"] if spec.has_step else [])]):  # a missing step: torch raises too
            raise ValueError(f"state_dict state of {names[ours]} has {sorted(entry)}, {name} keeps {kept} "
                             f"with the state_dict's hyperparameters of param_groups[{shard.group}]")
        if bad := [key for key, shape in found.items() if shape != spec.shapes[key]]:
            raise ValueError(f"state_dict state of {names[ours]} has {found} (key: shape), {name} keeps {spec.shapes} for it with the "
                             f"state_dict's hyperparameters of param_groups[{shard.group}] ({bad[0]!r} of {names[ours]} has shape {found[bad[0]]})")
        steps[ours] = int(float(entry["step"])) if "step" in entry else 1
    state: dict[Tensor, dict[str, Any]] = {}
    masters = []
    saved_masters = meta.get("master") or {}
    for k, shard in enumerate(view.shards):
        for piece, vparam in zip(shard.pieces, shard.virtual_params):
            ours = shard.param_indices[piece.param]
            span = slice(piece.param_offset, piece.param_offset + piece.numel)  # the piece within its param
            if steps[ours]:
                entry = state_dict["state"][order[ours]]
                state[vparam] = {key: copy_state_value(entry[key]) if whole else entry[key].reshape(-1)[span].clone() for key in specs[ours].shapes}
                if specs[ours].has_step:
                    state[vparam]["step"] = torch.tensor(float(steps[ours]))
            if saves_master(shard):
                master = saved_masters.get(order[ours])
                values = shard.buffer.data[piece.flat_offset : piece.flat_offset + piece.numel] if master is None else master.reshape(-1)[span]
                masters.append((k, piece.shard_offset, values))
    return inner_state_dict(view, state, saved_groups), steps, masters
