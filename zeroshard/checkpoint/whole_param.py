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

import inspect
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from zeroshard.checkpoint.full import check_full, full_envelope
from zeroshard.checkpoint.sharded import (
    SHARDED_FORMAT,
    SHARDED_FORMAT_VERSION,
    CheckpointView,
    Loaded,
    _check_version,
    check_layout,
    check_saver,
    groups_without_params,
    inner_state_dict,
    layout_signature,
    master_hint,
    param_names,
    saves_master,
)
from zeroshard.comm import collectives
from zeroshard.layout.local_shard import LocalShard
from zeroshard.step.wrapped import constructor_kwargs, is_subclass_state, throwaway_state


class Subclass(NamedTuple):
    """A state tensor kept as a tensor subclass (torchao's ``OptimState8bit``, ``OptimState4bit``, ``OptimStateFp8``): how to
    rebuild it from its plain inner tensors (``codes``, ``scale``, ``qmap``), which the sharded format carries as
    ``"<key>.<inner>"`` entries, and the context ``__tensor_flatten__`` gives."""

    cls: type
    context: Any
    inner: dict[str, tuple[tuple[int, ...], torch.dtype]]  # inner tensor name -> (shape, dtype)
    size: torch.Size
    stride: tuple[int, ...]


class StateSpec(NamedTuple):
    """What an optimizer keeps for one param: each state tensor's shape and dtype (``step`` aside), whether it keeps ``step``,
    and (``subclasses``, by key) which state tensors are tensor subclasses."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    has_step: bool
    subclasses: dict[str, Subclass] = {}

    def entries(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The plain tensors a sharded checkpoint holds for the param: each state tensor, a subclass as its inner tensors."""
        found: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for key, shape in self.shapes.items():
            sub = self.subclasses.get(key)
            found.update({key: (shape, self.dtypes[key])} if sub is None else {f"{key}.{name}": inner for name, inner in sub.inner.items()})
        return found

    def flatten(self, state: dict[str, Any], device: torch.device) -> dict[str, Tensor]:
        """``state``'s tensors as :meth:`entries` names them, copied to ``device`` (zeros for a key ``state`` lacks)."""
        out: dict[str, Tensor] = {}
        for key in self.shapes:
            sub, held = self.subclasses.get(key), state.get(key)
            if sub is None:
                out[key] = held.detach().to(device, copy=True) if held is not None else torch.zeros(self.shapes[key], dtype=self.dtypes[key], device=device)
                continue
            if held is not None and type(held) is not sub.cls:
                raise ValueError(f"state[{key!r}] is a {type(held).__name__}; this optimizer keeps a {sub.cls.__name__} for such a param")
            for name, (shape, dtype) in sub.inner.items():
                out[f"{key}.{name}"] = (getattr(held, name).detach().to(device, copy=True) if held is not None
                                        else torch.zeros(shape, dtype=dtype, device=device))
        return out

    def mismatch(self, state: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """Per checkpoint entry of ``state`` (as :meth:`entries` names them) whose shape is not the spec's: (found, expected)."""
        found: dict[str, tuple[int, ...]] = {}
        for key in self.shapes:
            held, sub = state.get(key), self.subclasses.get(key)
            if held is None:
                continue
            if sub is None or type(held) is not sub.cls:
                found[key] = tuple(held.shape)
            else:
                found.update({f"{key}.{name}": tuple(getattr(held, name).shape) for name in sub.inner})
        expected = {key: shape for key, (shape, _) in self.entries().items()}
        return {key: (shape, expected.get(key, ())) for key, shape in found.items() if expected.get(key) != shape}

    def unflatten(self, entry: dict[str, Tensor]) -> dict[str, Tensor]:
        """The state tensors from a checkpoint entry as :meth:`entries` names them: copies, subclasses rebuilt."""
        state: dict[str, Tensor] = {}
        for key in self.shapes:
            sub = self.subclasses.get(key)
            if sub is None:
                state[key] = entry[key].clone()
            else:
                inner = {name: entry[f"{key}.{name}"].clone() for name in sub.inner}
                state[key] = rebuild(sub.cls, inner, sub.context, sub.size, sub.stride)
        return state


def copy_state_value(value: Any) -> Any:
    """A copy of one state value: ``clone()`` for a plain tensor, the inner tensors cloned for a subclass (which may not implement ``clone``)."""
    if not is_subclass_state(value):
        return value.clone() if isinstance(value, Tensor) else value
    names, context = value.__tensor_flatten__()
    return rebuild(type(value), {name: getattr(value, name).clone() for name in names}, context, value.size(), value.stride())


def rebuild(cls: type, inner: dict[str, Tensor], context: Any, size: Any, stride: Any) -> Tensor:
    """A tensor subclass ``cls`` made from its ``inner`` tensors and ``context`` (``__tensor_unflatten__``)."""
    return cls.__tensor_unflatten__(inner, context, torch.Size(size), tuple(stride))  # type: ignore[attr-defined]


def _subclass(value: Tensor) -> Subclass:
    names, context = value.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = {name: (tuple(getattr(value, name).shape), getattr(value, name).dtype) for name in names}
    return Subclass(type(value), context, inner, value.size(), tuple(value.stride()))


_SPECS: dict[tuple[Any, ...], StateSpec] = {}


def state_spec(optimizer: torch.optim.Optimizer, hyperparameters: dict[str, Any], shape: torch.Size | tuple[int, ...],
               dtype: torch.dtype) -> StateSpec:
    """The state ``optimizer``'s class keeps for a param of ``shape`` and ``dtype`` in a param group with ``hyperparameters``
    (see the module docstring), cached per class, hyperparameters (the learning rate aside), shape and dtype.

    Raises:
        ValueError: the class cannot be built or stepped with these hyperparameters on such a param, or it keeps state
            that is not a tensor (other than ``step``), which zeroshard checkpoints do not carry.
    """
    cls = type(optimizer)
    hyperparameters = {**instance_options(optimizer, hyperparameters), **hyperparameters}
    kwargs = constructor_kwargs(cls, hyperparameters)
    # The learning rate (which schedules change every step) does not decide what state is kept.
    key = (cls, repr(sorted((k, v) for k, v in kwargs.items() if k not in ("lr", "initial_lr"))), tuple(shape), dtype)
    if key in _SPECS:
        return _SPECS[key]
    error: Exception | None = None
    for device in ("meta", "cpu"):
        try:
            sample = throwaway_state(cls, hyperparameters, shape, dtype, device)
            break
        except (TypeError, ValueError, RuntimeError, NotImplementedError) as caught:
            error = caught
    else:
        raise ValueError(f"{cls.__name__} cannot be stepped on a param of shape {tuple(shape)} with the hyperparameters {kwargs}: {error}")
    tensors = {k: v for k, v in sample.items() if torch.is_tensor(v) and k != "step"}
    others = sorted(k for k in sample if k not in tensors and k != "step")
    if others:
        raise ValueError(f"{cls.__name__} keeps state {others} that is not a tensor; zeroshard checkpoints carry tensors and 'step' only")
    subclasses = {k: _subclass(v) for k, v in tensors.items() if is_subclass_state(v)}
    _SPECS[key] = StateSpec({k: tuple(v.shape) for k, v in sorted(tensors.items())}, {k: v.dtype for k, v in tensors.items()}, "step" in sample,
                            subclasses)
    return _SPECS[key]


def instance_options(optimizer: torch.optim.Optimizer, hyperparameters: dict[str, Any]) -> dict[str, Any]:
    """Constructor arguments ``optimizer`` keeps as plain attributes rather than in its param groups (torchao's
    ``block_size`` and ``bf16_stochastic_round``), by name: they decide the state's shapes as much as the groups' do."""
    try:
        names = inspect.signature(type(optimizer).__init__).parameters
    except (TypeError, ValueError):
        return {}
    found = {name: getattr(optimizer, name, None) for name in names if name not in ("self", "params") and name not in hyperparameters}
    return {name: value for name, value in found.items() if isinstance(value, (bool, int, float, str))}


def _owned(view: CheckpointView) -> Iterator[tuple[int, LocalShard, Any, nn.Parameter, int]]:
    """(shard index, shard, piece, virtual param, ``torch.optim`` index) of every param this rank owns."""
    for k, shard in enumerate(view.shards):
        for piece, vparam in zip(shard.pieces, shard.virtual_params):
            yield k, shard, piece, vparam, shard.param_indices[piece.param]


def _spec(view: CheckpointView, groups: list[dict[str, Any]], shard: LocalShard, shape: torch.Size) -> StateSpec:
    return state_spec(view.optimizer, groups[shard.group], shape, shard.master_dtype)


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


def check_saved_entries(view: CheckpointView, saved: set[str], partition: str) -> None:
    """:func:`~zeroshard.verify_checkpoint`: the entries ``dcp.load`` will ask for are saved (``saved``: entry names under the
    optimizer's key, as ``"params.3.exp_avg"``): with ``partition="param"`` the state of each param this rank owns (a master
    too many is dropped on load), then each param group's settings. DCP would fail on the first missing one: "Missing key".

    Raises:
        ValueError: a param saved with other state (named, both key lists), or a group saved without a setting it has.
    """
    name = type(view.optimizer).__name__
    if partition == "param":
        found: dict[str, set[str]] = {}
        for entry in saved:
            kind, _, rest = entry.partition(".")
            position, _, key = rest.partition(".")  # the param's torch.optim index
            if kind == "params" and key and key != "master":
                found.setdefault(position, set()).add(key)
        names = param_names(view)
        for _, shard, _, vparam, index in _owned(view):
            wanted = set(_spec(view, view.optimizer.param_groups, shard, vparam.shape).entries())
            if (saved_keys := found.get(str(index), set())) != wanted:
                raise ValueError(f"{names[index]} was saved with optimizer state {sorted(saved_keys)}; {name} with this "
                                 f"optimizer's hyperparameters keeps {sorted(wanted)}: saved by another optimizer class or hyperparameters")
    # DCP saves a setting under its own name, or split into "<name>.<key or index>" entries (a dict; a list holding tensors),
    # or not at all (an empty dict).
    named = saved | {entry.rsplit(".", i)[0] for entry in saved for i in range(1, entry.count(".") + 1)}
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
    return {
        "zeroshard": {
            "format": SHARDED_FORMAT, "version": SHARDED_FORMAT_VERSION, "partition": "param", "layout": layout_signature(view),
            "rank": view.rank, "world_size": view.world_size, **_for_convert(view),
            "loss_scaler": view.loss_scaler.state_dict() if view.loss_scaler is not None else None,
        },
        "param_groups": groups_without_params(view.optimizer, view.group_params),
        "param_steps": torch.tensor(view.param_steps, dtype=torch.int64),
        "params": params,
    }


def load_sharded(view: CheckpointView, state_dict: dict[str, Any], filled_in_place: bool) -> Loaded:
    """As :func:`zeroshard.checkpoint.sharded.load_sharded`, for a ``partition="param"`` state dict.

    Raises:
        ValueError: another format version or partition mode, another rank's shard (not through DCP), another layout (a param
            named with both shapes), or a param's entry with other state or shapes than the saved hyperparameters keep.
    """
    meta = state_dict["zeroshard"]
    _check_version(meta)
    check_saver(view, meta, filled_in_place, "param")
    check_layout(view, meta.get("layout", []))
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(view.optimizer.param_groups):
        raise ValueError(f"state_dict has {len(saved_groups)} param groups, this optimizer {len(view.optimizer.param_groups)}")
    steps = [int(s) for s in state_dict["param_steps"].tolist()]
    if len(steps) != len(view.param_steps):
        raise ValueError(f"state_dict has steps for {len(steps)} params, this optimizer has {len(view.param_steps)}")
    names = param_names(view)
    entries = state_dict.get("params") or {}
    state: dict[Tensor, dict[str, Any]] = {}
    masters = []
    for k, shard, piece, vparam, index in _owned(view):
        spec = _spec(view, saved_groups, shard, vparam.shape)
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


def load_full(view: CheckpointView, state_dict: dict[str, Any]) -> Loaded:
    """As :func:`zeroshard.checkpoint.full.load_full`, taking this rank's params' state whole; every param's entry is checked
    on every rank, so a bad dict raises alike everywhere.

    Raises:
        ValueError: as :func:`zeroshard.checkpoint.full.check_full`, or a param's state with other keys, types or shapes than
            the saved hyperparameters keep (named).
    """
    order, meta = check_full(view, state_dict)
    names = param_names(view)
    saved_groups = state_dict["param_groups"]
    specs: dict[int, StateSpec] = {}
    steps = [0] * len(order)
    for shard in view.shards:
        for i, param in enumerate(shard.buffer.params):
            ours = shard.param_indices[i]
            entry = state_dict["state"].get(order[ours])
            if not entry:
                continue
            spec = specs[ours] = _spec(view, saved_groups, shard, param.shape)
            found = {key: tuple(value.shape) for key, value in entry.items() if key != "step"}
            kinds = {key: type(value) for key, value in entry.items() if key in spec.subclasses and type(value) is not spec.subclasses[key].cls}
            if kinds:
                raise ValueError(f"state_dict state of {names[ours]} holds {sorted((k, t.__name__) for k, t in kinds.items())} (key, type) where "
                                 f"{type(view.optimizer).__name__} keeps {sorted((k, sub.cls.__name__) for k, sub in spec.subclasses.items())}")
            if found != spec.shapes:
                raise ValueError(f"state_dict state of {names[ours]} has {found} (key: shape), {type(view.optimizer).__name__} keeps "
                                 f"{spec.shapes} for it with the state_dict's hyperparameters of param_groups[{shard.group}]")
            steps[ours] = int(float(entry["step"])) if "step" in entry else 1
    state: dict[Tensor, dict[str, Any]] = {}
    masters = []
    saved_masters = meta.get("master") or {}
    for k, shard, piece, vparam, ours in _owned(view):
        if steps[ours]:
            entry = state_dict["state"][order[ours]]
            state[vparam] = {key: copy_state_value(entry[key]) for key in specs[ours].shapes}
            if specs[ours].has_step:
                state[vparam]["step"] = torch.tensor(float(steps[ours]))
        if saves_master(shard):
            master = saved_masters.get(order[ours])
            values = shard.buffer.data[piece.flat_offset : piece.flat_offset + piece.numel] if master is None else master.reshape(-1)
            masters.append((k, piece.shard_offset, values))
    return inner_state_dict(view, state, saved_groups), steps, masters
