"""Both checkpoint formats of ``partition="param"`` (``docs/shape_aware.md``): the envelope of ``sharded.py`` and ``full.py``
(param groups, per-param steps, loss scaler, layout signature) around each param's state, whole, as such optimizers (Muon,
Adafactor) keep state that is not per-element:

* **sharded**: ``"params"``: per param this rank owns, keyed by its ``torch.optim`` index (a ``str``), each state tensor
  whole and the fp32 ``master`` of a 16-bit param: plain tensors, which DCP writes once and hands whole to each new owner
  at any world size. Params not yet stepped hold zeros (the steps say which hold state). Built with no collective.
* **full**: plain ``torch.optim`` format (``full.full_envelope``), sent by each owner to the consolidating rank point to point.

Which state tensors an optimizer keeps for a param, with their shapes, comes from one step of a throwaway instance on a
zero param of that shape (:func:`state_spec`): on the meta device where the optimizer allows it, else in host memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from zeroshard.checkpoint.full import full_envelope
from zeroshard.checkpoint.sharded import (
    CheckpointView,
    Loaded,
    check_envelope,
    check_meta,
    check_state_keys,
    group_state_keys,
    inner_state_dict,
    master_hint,
    param_names,
    saves_master,
    sharded_envelope,
)
from zeroshard.comm import collectives
from zeroshard.layout.local_shard import LocalShard
from zeroshard.step.wrapped import StateSpec, state_spec


def _owned(view: CheckpointView) -> Iterator[tuple[int, LocalShard, Any, nn.Parameter, int]]:
    """(shard index, shard, piece, virtual param, ``torch.optim`` index) of every param this rank owns."""
    for k, shard in enumerate(view.shards):
        for piece, vparam in zip(shard.pieces, shard.virtual_params):
            yield k, shard, piece, vparam, shard.param_indices[piece.param]


def _spec(view: CheckpointView, groups: list[dict[str, Any]], shard: LocalShard, shape: torch.Size) -> StateSpec:
    return state_spec(view.optimizer, groups[shard.group], shape, shard.master_dtype, ("meta", "cpu", shard.buffer.device))


def _master(shard: LocalShard, piece: Any, shape: torch.Size) -> Tensor:
    """A copy of ``piece``'s master in ``shape`` on the params' device."""
    return shard.master_view(piece.shard_offset, piece.numel).to(shard.buffer.device, copy=True).view(shape)


def _for_convert(view: CheckpointView) -> dict[str, Any]:
    """What ``zeroshard.convert`` needs to rebuild ``torch.optim`` state: per param group, whether the optimizer keeps ``step``
    (``"keeps_step"``); per ``torch.optim`` index (a ``str``) of every param whose state holds a tensor subclass, per such key,
    its class (``"module:qualname"``), context, size and stride (``"subclasses"``). The same on every rank (specs depend on the
    param shapes only), so any rank's copy serves."""
    keeps: list[bool] = [False] * len(view.group_params)
    table: dict[str, Any] = {}
    for shard in view.shards:
        for i, param in enumerate(shard.buffer.params):
            spec = _spec(view, view.optimizer.param_groups, shard, param.shape)
            if i == 0:
                keeps[shard.group] = spec.has_step
            if spec.subclasses:
                table[str(shard.param_indices[i])] = {key: {"cls": f"{sub.cls.__module__}:{sub.cls.__qualname__}", "context": sub.context,
                                                            "size": list(sub.size), "stride": list(sub.stride)} for key, sub in spec.subclasses.items()}
    return {"keeps_step": keeps, "subclasses": table}


def check_saved(view: CheckpointView, meta: dict[str, Any], saved: dict[str, tuple[int, ...] | None]) -> None:
    """:func:`~zeroshard.verify_checkpoint`'s checks, before any load, of a sharded checkpoint's ``"zeroshard"`` entry ``meta`` and
    of the entries ``dcp.load`` will ask for (``saved``: entry names under the optimizer's key, as ``"params.3.exp_avg"``, with
    their tensor's size or ``None``; DCP would fail on the first missing one, "Missing key"): :func:`check_meta`, masters, the state
    each param group keeps (flat) or each param this rank owns has, with its shapes (a master too many is dropped on load), then
    each param group's settings.

    Raises:
        ValueError: see :func:`check_meta`; no masters where this optimizer keeps them; other state (named, both key lists, or
            the keys of other shapes with both); a group saved without a setting it has.
    """
    check_meta(view, meta, True)
    if any(saves_master(shard) for shard in view.shards) and not any(entry.endswith(".master") for entry in saved):  # the reverse loads
        raise ValueError(f"the checkpoint holds no fp32 masters of 16-bit params, this optimizer keeps them.{master_hint([], ['master'])}")
    if "state_keys" in meta:
        check_state_keys(view, meta, group_state_keys(view, view.optimizer.param_groups), "this optimizer's hyperparameters")
    name = type(view.optimizer).__name__
    if view.partition == "param":
        found: dict[str, set[str]] = {}
        for entry in saved:
            kind, _, rest = entry.partition(".")
            position, _, key = rest.partition(".")  # the param's torch.optim index
            if kind == "params" and key and key != "master":
                found.setdefault(position, set()).add(key)
        names = param_names(view)
        for _, shard, _, vparam, index in _owned(view):
            wanted = _spec(view, view.optimizer.param_groups, shard, vparam.shape).entries()
            if (saved_keys := found.get(str(index), set())) != set(wanted):
                raise ValueError(f"{names[index]} was saved with optimizer state {sorted(saved_keys)}; {name} with this "
                                 f"optimizer's hyperparameters keeps {sorted(wanted)}: saved by another optimizer class or hyperparameters")
            sizes = {key: (saved[f"params.{index}.{key}"], shape) for key, (shape, _) in wanted.items()}
            if other := {key: pair for key, pair in sizes.items() if pair[0] not in (None, pair[1])}:
                raise ValueError(f"{names[index]} was saved with optimizer state of other shapes {other} (key: (saved, expected)): saved by "
                                 f"another optimizer class (torchao's AdamW8bit for an AdamW4bit) or with other options (block_size)")
    # DCP saves a setting under its own name, or split into "<name>.<key or index>" entries (a dict; a list holding tensors),
    # or not at all (an empty dict).
    named = set(saved) | {entry.rsplit(".", i)[0] for entry in saved for i in range(1, entry.count(".") + 1)}
    for g, group in enumerate(view.optimizer.param_groups):
        if f"param_groups.{g}.params" not in saved:
            continue  # fewer groups saved: check_layout names the params
        if missing := [key for key, value in group.items() if f"param_groups.{g}.{key}" not in named and value != {}]:
            raise ValueError(f"param_groups[{g}] was saved without {missing}, which {name}'s has: saved by another optimizer class, "
                             "or before the setting was added to the group (dcp.load asks for every setting the group has)")


# -- sharded format ----------------------------------------------------------------------------


def sharded_state_dict(view: CheckpointView) -> dict[str, Any]:
    """This rank's params' state, whole (see the module docstring). Copies; runs no collective."""
    groups = view.optimizer.param_groups
    params: dict[str, dict[str, Tensor]] = {}
    for _, shard, piece, vparam, index in _owned(view):
        spec = _spec(view, groups, shard, vparam.shape)
        entry = spec.flatten(view.optimizer.state.get(vparam, {}), shard.buffer.device)
        if saves_master(shard):
            entry["master"] = _master(shard, piece, vparam.shape)
        params[str(index)] = entry
    return sharded_envelope(view, _for_convert(view), params=params)


def load_sharded(view: CheckpointView, state_dict: dict[str, Any], filled_in_place: bool) -> Loaded:
    """As :func:`zeroshard.checkpoint.sharded.load_sharded`, for a ``partition="param"`` state dict.

    Raises:
        ValueError: another format version or partition mode, another rank's shard (not through DCP), another layout (a param
            named with both shapes), or a param's entry with other state or shapes than the saved hyperparameters keep.
    """
    saved_groups, steps = check_envelope(view, state_dict, filled_in_place)
    names = param_names(view)
    entries = state_dict.get("params") or {}
    saved_classes = state_dict["zeroshard"].get("subclasses")  # per param, per key, the saved state's class (as _for_convert)
    state: dict[Tensor, dict[str, Any]] = {}
    masters = []
    for k, shard, piece, vparam, index in _owned(view):
        spec = _spec(view, saved_groups, shard, vparam.shape)
        classes = {key: f"{sub.cls.__module__}:{sub.cls.__qualname__}" for key, sub in spec.subclasses.items()}
        if saved_classes is not None and classes != (saved := {key: sub["cls"] for key, sub in saved_classes.get(str(index), {}).items()}):
            # dcp.load fills the inner tensors both kinds share (torchao's 8-bit codes into float8 ones) without a word
            raise ValueError(f"{names[index]} was saved with optimizer state {saved or 'of plain tensors'} (key: class); "
                             f"{type(view.optimizer).__name__} here keeps {classes or 'plain tensors'}: saved by another optimizer class")
        wanted = {**{key: shape for key, (shape, _) in spec.entries().items()}, **({"master": tuple(vparam.shape)} if saves_master(shard) else {})}
        entry = entries.get(str(index))
        found = None if entry is None else {key: tuple(value.shape) for key, value in entry.items()}
        if entry is None or found != wanted:
            hint = (" this optimizer's state_dict() gave dcp.load other entries to fill than the checkpoint holds: build the optimizer with "
                    "the checkpoint's hyperparameters" if filled_in_place else "")
            raise ValueError(f"state_dict holds {found} (key: shape) for {names[index]}; {type(view.optimizer).__name__} with the "
                             f"state_dict's hyperparameters keeps {wanted}.{hint}{master_hint(found, wanted)}")
        if steps[index]:
            state[vparam] = spec.unflatten(entry)
            if spec.has_step:
                state[vparam]["step"] = torch.tensor(float(steps[index]))
        if "master" in entry:
            masters.append((k, piece.shard_offset, entry["master"].reshape(-1)))
    return inner_state_dict(view, state, saved_groups), steps, masters


# -- full format -------------------------------------------------------------------------------


def consolidate(view: CheckpointView, to: int) -> dict[str, Any] | None:
    """Gather the full state onto global rank ``to``; the full dict there, else ``None``.

    A collective over ``to``'s shard group (other shard groups return at once): every owner sends its stepped params' state
    tensors, and the master of each 16-bit param, to ``to`` one at a time, in the same order on every rank.
    """
    if to not in dist.get_process_group_ranks(view.shard_group):
        return None
    here = dist.get_rank() == to
    dst = dist.get_group_rank(view.shard_group, to)
    groups = view.optimizer.param_groups
    _check_shapes_everywhere(view)
    state: dict[int, dict[str, Any]] = {}
    masters: dict[int, Tensor] = {}
    for shard in view.shards:
        owners = shard.buffer.layout.owners
        if owners is None:
            raise RuntimeError("internal error: a partition='param' optimizer has a flat buffer without owners")
        mine = {piece.param: (piece, vparam) for piece, vparam in zip(shard.pieces, shard.virtual_params)}
        for i, param in enumerate(shard.buffer.params):
            owner, index = owners[i], shard.param_indices[i]
            if owner != view.rank and not here:
                continue
            spec, step = _spec(view, groups, shard, param.shape), view.param_steps[index]
            # A subclass state tensor travels as its inner tensors (plain: send and recv take no subclass), rebuilt on ``to``.
            wanted = {**(spec.entries() if step else {}), **({"master": (tuple(param.shape), shard.master_dtype)} if saves_master(shard) else {})}
            held = {}
            if owner == view.rank:
                piece, vparam = mine[i]
                held = spec.flatten(view.optimizer.state.get(vparam, {}), shard.buffer.device) if step else {}
                if saves_master(shard):
                    held["master"] = _master(shard, piece, param.shape)
            values: dict[str, Tensor] = {}
            for key, (shape, dtype) in wanted.items():
                if owner == view.rank:
                    value = held[key].contiguous()
                    if not here:
                        collectives.send(value, dst, view.shard_group, view.timeout)
                else:
                    value = torch.empty(shape, dtype=dtype, device=shard.buffer.device)
                    collectives.recv(value, owner, view.shard_group, view.timeout)
                values[key] = value
            if here:
                if "master" in values:
                    masters[index] = values.pop("master")
                if step:
                    state[index] = {**({"step": torch.tensor(float(step))} if spec.has_step else {}), **spec.unflatten(values)}
    return full_envelope(view, dict(sorted(state.items())), masters) if here else None


def _check_shapes_everywhere(view: CheckpointView) -> None:
    """Raise ``RuntimeError`` on every rank (naming this rank's mismatches) if some rank's params' state has other shapes than
    the spec: one all-reduce, so that no receive of the wrong size aborts the process group (or waits forever)."""
    names, groups = param_names(view), view.optimizer.param_groups
    bad = []
    for _, shard, _, vparam, index in _owned(view):
        found = _spec(view, groups, shard, vparam.shape).mismatch(view.optimizer.state.get(vparam, {}))
        if found:
            bad.append(f"{names[index]}: {found} (key: (found, expected))")
    flag = torch.tensor([float(len(bad))], device=view.shards[0].buffer.device if view.shards else None)
    collectives.wait(collectives.all_reduce(flag, view.shard_group, op=dist.ReduceOp.MAX), view.timeout,
                     "consolidate_state_dict(): the check of the state's shapes", "call consolidate_state_dict() on every rank")
    if flag.item():
        raise RuntimeError(f"{type(view.optimizer).__name__} keeps state of other shapes than zeroshard expects from its hyperparameters "
                           f"(on this rank: {bad or 'none'}); nothing was sent. Which state a param has comes from one step of a "
                           "throwaway optimizer built from the param group's hyperparameters and the options the optimizer keeps as attributes")
