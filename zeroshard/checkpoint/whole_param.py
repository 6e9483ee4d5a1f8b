"""Checkpoints of whole-param shards (``partition="param"``): each param's state, whole, on its owner.

The same two formats as ``zeroshard/checkpoint/sharded.py`` (sharded) and ``zeroshard/checkpoint/full.py``
(full), with the same envelope (param groups, per-param steps, loss scaler, layout signature) and
another payload, because an optimizer such as Muon or Adafactor keeps state that is not
per-element (Adafactor's ``row_var``/``col_var``) and each param lives on one rank:

* **sharded**: ``"params"``: for each param this rank owns, keyed by its ``torch.optim`` index
  (a ``str``), every state tensor the wrapped optimizer keeps for it, whole and in its own shape
  (Muon's ``momentum_buffer``; Adafactor's ``row_var`` and ``col_var``, or ``variance`` for a
  vector), and the fp32 ``master`` of a 16-bit param. Plain tensors, not DTensors: each entry is
  written by its owner (by one of its replicas with hybrid sharding: ``torch.distributed.checkpoint``
  writes a key held by several ranks once), and ``dcp.load`` at any other world size hands each new
  owner the whole entries of its params. Entries of params not yet stepped are zeros; the steps
  say which hold state. Built with no collective.
* **full**: plain ``torch.optim`` format (``full.full_envelope``); each owner sends its
  params' state to the consolidating rank, point to point, one tensor at a time.

Which state tensors an optimizer keeps for a param, with their shapes, comes from one step of a
throwaway instance on a zero param of that shape (:func:`state_spec`): on the meta device where
the optimizer allows it (no memory, no work; Muon does), else in host memory (Adafactor reads a
value with ``.item()``).
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
    """A state tensor kept as a tensor subclass (torchao's ``OptimState8bit``, ``OptimState4bit``, ``OptimStateFp8``): how to rebuild it.

    Such a tensor is made of plain inner tensors (8-bit ``codes``, fp32 block ``scale``, a ``qmap``)
    and a context of plain values, as PyTorch's traceable-subclass protocol gives them
    (``__tensor_flatten__`` / ``__tensor_unflatten__``). Checkpoints carry the inner tensors, bit
    for bit, as ``"<key>.<inner>"`` entries of the sharded format; the class and context come
    from the spec (the same optimizer class and hyperparameters on the same shape make the same).
    """

    cls: type
    context: Any
    inner: dict[str, tuple[tuple[int, ...], torch.dtype]]  # inner tensor name -> (shape, dtype)
    size: torch.Size
    stride: tuple[int, ...]


class StateSpec(NamedTuple):
    """What an optimizer keeps for one param: each state tensor's shape and dtype (``step`` aside), and whether it keeps ``step``.

    ``subclasses``: the state tensors that are tensor subclasses (see :class:`Subclass`), by key.
    """

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    has_step: bool
    subclasses: dict[str, Subclass] = {}

    def entries(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The plain tensors a sharded checkpoint holds for the param: each state tensor, a subclass as its inner tensors."""
        found: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for key, shape in self.shapes.items():
            sub = self.subclasses.get(key)
            if sub is None:
                found[key] = (shape, self.dtypes[key])
            else:
                found.update({f"{key}.{name}": inner for name, inner in sub.inner.items()})
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
    """The state ``optimizer``'s class keeps for a param of ``shape`` and ``dtype`` in a param group with ``hyperparameters``.

    Read from one step of a throwaway instance of the class (see the module docstring); the
    optimizer itself is never touched. Cached per class, hyperparameters (the learning rate aside),
    shape and dtype.

    Raises:
        ValueError: the class cannot be built or stepped with these hyperparameters on such a
            param, or it keeps state that is not a tensor (other than ``step``), which zeroshard
            checkpoints do not carry.
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
    spec = StateSpec({k: tuple(v.shape) for k, v in sorted(tensors.items())}, {k: v.dtype for k, v in tensors.items()}, "step" in sample,
                     subclasses)
    _SPECS[key] = spec
    return spec


def instance_options(optimizer: torch.optim.Optimizer, hyperparameters: dict[str, Any]) -> dict[str, Any]:
    """Constructor arguments ``optimizer`` keeps as plain attributes rather than in its param groups (torchao's
    ``block_size`` and ``bf16_stochastic_round``), by name: they decide the state's shapes as much as the groups' do."""
    try:
        names = inspect.signature(type(optimizer).__init__).parameters
    except (TypeError, ValueError):
        return {}
    found = {}
    for name in names:
        value = getattr(optimizer, name, None) if name not in ("self", "params") and name not in hyperparameters else None
        if isinstance(value, (bool, int, float, str)):
            found[name] = value
    return found


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


def _subclass_table(view: CheckpointView) -> dict[str, dict[str, dict[str, Any]]]:
    """Per ``torch.optim`` index (a ``str``) of every param whose state holds a tensor subclass: per such key, its
    class (``"module:qualname"``), context, size and stride, for ``zeroshard.checkpoint.convert`` to rebuild it from the
    inner tensors. The same on every rank (specs depend on the param shapes only), so any rank's copy serves."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for shard in view.shards:
        for i, param in enumerate(shard.buffer.params):
            spec = _spec(view, view.optimizer.param_groups, shard, param.shape)
            if spec.subclasses:
                table[str(shard.param_indices[i])] = {
                    key: {"cls": f"{sub.cls.__module__}:{sub.cls.__qualname__}", "context": sub.context, "size": list(sub.size),
                          "stride": list(sub.stride)}
                    for key, sub in spec.subclasses.items()
                }
    return table


def _keeps_step(view: CheckpointView) -> list[bool]:
    """Per param group, whether the optimizer keeps ``step`` for its params (for ``zeroshard.checkpoint.convert``)."""
    keeps = [False] * len(view.group_params)
    for shard in view.shards:
        keeps[shard.group] = _spec(view, view.optimizer.param_groups, shard, shard.buffer.params[0].shape).has_step
    return keeps


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
            "rank": view.rank, "world_size": view.world_size, "keeps_step": _keeps_step(view), "subclasses": _subclass_table(view),
            "loss_scaler": view.loss_scaler.state_dict() if view.loss_scaler is not None else None,
        },
        "param_groups": groups_without_params(view.optimizer, view.group_params),
        "param_steps": torch.tensor(view.param_steps, dtype=torch.int64),
        "params": params,
    }


def load_sharded(view: CheckpointView, state_dict: dict[str, Any], filled_in_place: bool) -> tuple[dict[str, Any], list[int], list[tuple[int, int, Tensor]]]:
    """Check a sharded ``partition="param"`` state dict and turn it into (wrapped optimizer state
    dict, param steps, masters as (shard, offset in its master shard, 1-D values)).

    As :func:`zeroshard.checkpoint.sharded.load_sharded`; nothing is written here.

    Raises:
        ValueError: another format version or partition mode, another rank's shard (not through
            DCP), another layout (a param named with both shapes), or a param's entry with other
            state than the saved hyperparameters keep or with other shapes (named).
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

    A collective over ``to``'s shard group (other shard groups return at once): every owner sends
    its stepped params' state tensors, and the master of each 16-bit param, to ``to`` one at a
    time, in the same order on every rank. Ranks other than ``to`` hold nothing extra.
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
            spec = _spec(view, groups, shard, param.shape)
            # A subclass state tensor travels as its inner tensors (plain: send and recv take no subclass), rebuilt on ``to``.
            wanted = {**(spec.entries() if view.param_steps[index] else {}),
                      **({"master": (tuple(param.shape), shard.master_dtype)} if saves_master(shard) else {})}
            held = {}
            if owner == view.rank:
                piece, vparam = mine[i]
                held = spec.flatten(view.optimizer.state.get(vparam, {}), shard.buffer.device) if view.param_steps[index] else {}
                if saves_master(shard):
                    held["master"] = _master(shard, piece, param.shape)
            values: dict[str, Tensor] = {}
            for key, (shape, dtype) in wanted.items():
                if owner == view.rank:
                    value = held[key].contiguous()
                    if not here:
                        collectives.send(value, dst, view.shard_group)
                else:
                    value = torch.empty(shape, dtype=dtype, device=shard.buffer.device)
                    collectives.recv(value, owner, view.shard_group)
                values[key] = value
            if here:
                if "master" in values:
                    masters[index] = values.pop("master")
                if view.param_steps[index]:
                    state[index] = {**({"step": torch.tensor(float(view.param_steps[index]))} if spec.has_step else {}), **spec.unflatten(values)}
    return full_envelope(view, dict(sorted(state.items())), masters) if here else None


def _check_shapes_everywhere(view: CheckpointView) -> None:
    """Before the state travels point to point: every rank checks that its params' state has the shapes every other rank
    expects (from the spec), and all learn of a mismatch anywhere in one all-reduce, so all raise together instead of a
    receive of the wrong size aborting the process group (or waiting forever).

    Raises:
        RuntimeError: some rank's state has other shapes than the spec (this rank's mismatches are named).
    """
    names, groups = param_names(view), view.optimizer.param_groups
    bad = []
    for _, shard, _, vparam, index in _owned(view):
        found = _spec(view, groups, shard, vparam.shape).mismatch(view.optimizer.state.get(vparam, {}))
        if found:
            bad.append(f"{names[index]}: {found} (key: (found, expected))")
    flag = torch.tensor([float(len(bad))], device=view.shards[0].buffer.device if view.shards else None)
    collectives.wait(collectives.all_reduce(flag, view.shard_group, op=dist.ReduceOp.MAX), None,
                     "consolidate_state_dict(): the check of the state's shapes", "call consolidate_state_dict() on every rank")
    if flag.item():
        raise RuntimeError(f"{type(view.optimizer).__name__} keeps state of other shapes than zeroshard expects from its hyperparameters "
                           f"(on this rank: {bad or 'none'}); nothing was sent. Which state a param has comes from one step of a "
                           "throwaway optimizer built from the param group's hyperparameters and the options the optimizer keeps as attributes")


def load_full(view: CheckpointView, state_dict: dict[str, Any]) -> tuple[dict[str, Any], list[int], list[tuple[int, int, Tensor]]]:
    """Check a full ``torch.optim``-format state dict and take this rank's params' state from it.

    As :func:`zeroshard.checkpoint.full.load_full` (dicts from either partition mode, or from an
    unsharded optimizer of the same class): every param's entry is checked on every rank, so a
    bad dict raises alike everywhere. Nothing is written here.

    Raises:
        ValueError: as :func:`zeroshard.checkpoint.full.check_full`, or a param's state with other keys
            or shapes than the saved hyperparameters keep (named).
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
