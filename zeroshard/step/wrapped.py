"""The update of optimizers other than the fused Adam/AdamW (their own ``step()`` on the virtual params), the multiplier every
path applies to the gradients, and what state the wrapped optimizer keeps for a param (for checkpoints and memory estimates)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from zeroshard.compat import step_with_own_hooks
from zeroshard.layout.local_shard import LocalShard


def grad_multiplier(norm: float, loss_scale: float, max_norm: float | None) -> float:
    """What the reduced gradients are multiplied by: ``1 / loss_scale`` times the clip coefficient.

    ``norm`` is the global norm of the still-scaled gradients; the clip coefficient is
    ``min(1, max_norm / (norm / loss_scale + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``'s.
    """
    coefficient = 1.0 if max_norm is None else min(1.0, max_norm / (norm / loss_scale + 1e-6))
    return coefficient / loss_scale


@torch.no_grad()
def wrapped_step(optimizer: torch.optim.Optimizer, shards: list[LocalShard], used: list[list[bool]], multiplier: float) -> None:
    """Run ``optimizer.step()`` on the virtual params, each with its piece of the grad shards (multiplied by ``multiplier``
    in place) as ``.grad``, or ``None`` where ``used`` (per shard, per param) says no rank gave the param a gradient; then
    16-bit params receive the cast of their updated masters (without ``master_weights`` the virtual params are the params' views).
    """
    for shard, flags in zip(shards, used):
        if multiplier != 1.0:
            shard.grad_shard.mul_(multiplier)
        shard.attach_grads(flags)
    try:
        step_as_wrapped(optimizer)
    except KeyError as error:
        if (name := _virtual_param_name(shards, error.args[0] if error.args else None)) is not None:
            raise RuntimeError(f"{type(optimizer).__name__}.step() looked up a param in a dict of its own and got a KeyError: zeroshard "
                               f"hands it a virtual param for {name} (this rank's piece of that param), not the param it keyed the dict "
                               "by when it was built. Keep per-param data in the param group (an option of its own) or in optimizer.state "
                               "(zeroshard shards it), or build the dict from param_groups in step()") from error
        raise
    for shard in shards:
        shard.detach_grads()
        shard.write_back()


_STEPPING: set[int] = set()  # ids of wrapped optimizers inside step_as_wrapped


def step_as_wrapped(optimizer: torch.optim.Optimizer, update: Callable[[], None] | None = None) -> None:
    """Run ``update`` (the fused update; ``None``: ``optimizer``'s own ``step``) as ``optimizer``'s step: its own step hooks run
    around it once, torch's global ones not again (:func:`~zeroshard.compat.step_with_own_hooks`), and
    :func:`refuse_direct_steps` lets it through."""
    _STEPPING.add(id(optimizer))
    try:
        step_with_own_hooks(optimizer, update)
    finally:
        _STEPPING.discard(id(optimizer))


def _virtual_param_name(shards: list[LocalShard], key: object) -> str | None:
    """How errors name the param whose virtual param ``key`` is (``None``: ``key`` is none of ``shards``' virtual params)."""
    for shard in shards:
        for piece, vparam in zip(shard.pieces, shard.virtual_params):
            if vparam is key:
                return shard.buffer.names[piece.param]
    return None


def refuse_direct_steps(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.step()`` raise ``RuntimeError`` outside :func:`step_as_wrapped`: it would update this rank's shard alone."""
    def refuse(stepped: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if id(stepped) not in _STEPPING:
            raise RuntimeError(f"{type(stepped).__name__}.step() was called on the optimizer a ShardedOptimizer wraps: it updates this rank's "
                               "shard only, and no rank gathers the result. Call the ShardedOptimizer's step() (opt.step(), not opt.optimizer.step())")

    optimizer.register_step_pre_hook(refuse)


def is_subclass_state(value: Any) -> bool:
    """Whether ``value`` is a tensor subclass that follows PyTorch's flatten/unflatten protocol (torchao's ``OptimState8bit``)."""
    return isinstance(value, Tensor) and type(value) not in (Tensor, nn.Parameter) and hasattr(type(value), "__tensor_flatten__")


def constructor_kwargs(cls: type, hyperparameters: dict[str, Any]) -> dict[str, Any]:
    """The entries of a param group's ``hyperparameters`` that ``cls(params, **kwargs)`` takes: those its ``__init__`` names,
    or all of them (``"params"`` aside) when it takes ``**kwargs`` (a subclass that forwards them to its base class)."""
    accepted = inspect.signature(cls).parameters
    forwards = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    return {k: v for k, v in hyperparameters.items() if k != "params" and (forwards or k in accepted)}


def throwaway_state(optimizer: torch.optim.Optimizer, hyperparameters: dict[str, Any], shape: Any, dtype: torch.dtype, device: Any) -> dict[str, Any]:
    """The state ``optimizer``'s class keeps after one step of a zero param of ``shape``, ``dtype`` and ``device`` with a zero
    gradient, built as ``cls(params, **constructor_kwargs(cls, ...))`` from a param group's ``hyperparameters`` and the options
    ``optimizer`` keeps elsewhere (:func:`instance_options`). Raises whatever the class raises.

    The step runs eagerly: an update under ``torch.compile`` (torchao's low-bit AdamW) would be compiled again for each probe."""
    cls = type(optimizer)
    probe = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
    probe.grad = torch.zeros_like(probe)
    throwaway = cls([probe], **constructor_kwargs(cls, {**instance_options(optimizer, hyperparameters), **hyperparameters}))
    with torch.compiler.set_stance("force_eager"):
        throwaway.step()
    return throwaway.state[probe]


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
        """``state``'s tensors as :meth:`entries` names them, copied to ``device`` (zeros for a key ``state`` lacks).

        Raises:
            ValueError: ``state`` holds a tensor the spec lacks, or one of another dtype: a checkpoint would lose or recast it.
        """
        if odd := self._unexpected(state):
            raise ValueError(f"the optimizer's state holds {odd} (key: dtype), where one step of its class built from the param group "
                             f"keeps {({k: str(d) for k, d in self.dtypes.items()})}: an option the class keeps outside its param groups "
                             "changed it, and a checkpoint would lose it: zeroshard cannot checkpoint this optimizer as built")
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

    def _unexpected(self, state: dict[str, Any]) -> dict[str, str]:
        """The plain tensors of ``state`` (``step`` aside) the spec lacks or keeps in another dtype: key -> dtype."""
        return {key: str(v.dtype) for key, v in state.items() if key != "step" and isinstance(v, Tensor) and not is_subclass_state(v)
                and self.dtypes.get(key) != v.dtype}

    def mismatch(self, state: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """Per checkpoint entry of ``state`` (as :meth:`entries` names them) whose shape is not the spec's, or that the spec lacks
        or keeps in another dtype: (found, expected; ``()`` where the spec lacks it)."""
        odd = self._unexpected(state)
        found: dict[str, tuple[int, ...]] = {key: tuple(state[key].shape) for key in odd}
        for key in self.shapes:
            held, sub = state.get(key), self.subclasses.get(key)
            if held is None:
                continue
            if sub is None or type(held) is not sub.cls:
                found[key] = tuple(held.shape)
            else:
                found.update({f"{key}.{name}": tuple(getattr(held, name).shape) for name in sub.inner})
        expected = {key: shape for key, (shape, _) in self.entries().items()}
        return {key: (shape, expected.get(key, ())) for key, shape in found.items() if expected.get(key) != shape or key in odd}

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
               dtype: torch.dtype, devices: tuple[Any, ...]) -> StateSpec:
    """The state ``optimizer``'s class keeps for a param of ``shape`` and ``dtype`` in a param group with ``hyperparameters``,
    from one step on the first of ``devices`` that takes it, cached per class, hyperparameters (the learning rate aside),
    shape, dtype and devices.

    Raises:
        ValueError: the class cannot be built or stepped with these hyperparameters on such a param, or it keeps state
            that is not a tensor (other than ``step``), which zeroshard checkpoints do not carry.
    """
    cls = type(optimizer)
    # The learning rate (which schedules change every step) does not decide what state is kept: probed with one value, so the
    # answer does not depend on what the cache (per process) holds: as in torch, a loaded lr is not checked.
    hyperparameters = {**instance_options(optimizer, hyperparameters), **hyperparameters, **({"lr": 1e-3} if "lr" in hyperparameters else {})}
    kwargs = constructor_kwargs(cls, hyperparameters)
    # bitsandbytes' args by its attributes: its repr holds an address, which a later one may reuse.
    options = sorted((k, vars(v) if k == "args" and hasattr(v, "__dict__") else v) for k, v in kwargs.items() if k != "initial_lr")
    key = (cls, repr(options), tuple(shape), dtype, devices)
    if key in _SPECS:
        return _SPECS[key]
    error: Exception | None = None
    for device in devices:
        try:
            sample = throwaway_state(optimizer, hyperparameters, shape, dtype, device)
            break
        except (TypeError, ValueError, RuntimeError, NotImplementedError, AssertionError) as caught:  # capturable=True asserts CUDA
            error = caught
    else:
        raise ValueError(f"{cls.__name__} cannot be stepped on a param of shape {tuple(shape)} with the hyperparameters {dict(options)}: {error}")
    tensors = {k: v for k, v in sample.items() if torch.is_tensor(v) and k != "step"}
    others = sorted(k for k in sample if k not in tensors and k != "step")
    if others:
        raise ValueError(f"{cls.__name__} keeps state {others} that is not a tensor; zeroshard checkpoints carry tensors and 'step' only")
    subclasses = {k: _subclass(v) for k, v in tensors.items() if is_subclass_state(v)}
    _SPECS[key] = StateSpec({k: tuple(v.shape) for k, v in sorted(tensors.items())}, {k: v.dtype for k, v in tensors.items()}, "step" in sample,
                            subclasses)
    return _SPECS[key]


def instance_options(optimizer: torch.optim.Optimizer, hyperparameters: dict[str, Any]) -> dict[str, Any]:
    """Constructor arguments ``optimizer`` keeps outside its param groups, by name: they decide the state's shapes as much as
    the groups' do. Plain attributes of a constructor argument's name (torchao's ``block_size`` and
    ``bf16_stochastic_round``); bitsandbytes' ``args`` (its ``optim_bits``, ``min_8bit_size``, ...), and the ``momentum`` and
    ``dampening`` its ``SGD8bit`` and ``LARS`` keep as the group's ``betas``."""
    try:
        names = inspect.signature(type(optimizer).__init__).parameters
    except (TypeError, ValueError):
        return {}
    found = {name: getattr(optimizer, name, None) for name in names if name not in ("self", "params") and name not in hyperparameters}
    options = {name: value for name, value in found.items() if isinstance(value, (bool, int, float, str)) or name == "args" and hasattr(value, "__dict__")}
    betas = hyperparameters.get("betas")
    if {"momentum", "dampening"} <= set(found) and isinstance(betas, (tuple, list)) and len(betas) == 2:
        options.update(momentum=betas[0], dampening=betas[1])
    return options


def state_keys(optimizer: torch.optim.Optimizer, hyperparameters: dict[str, Any], dtype: torch.dtype, device: torch.device) -> tuple[list[str], bool]:
    """The per-element state keys (e.g. ``exp_avg``) ``optimizer``'s class keeps for a param group with ``hyperparameters``
    (``SGD`` keeps ``momentum_buffer`` only with ``momentum != 0``), and whether it keeps ``step``: :func:`state_spec` of a
    2-element param on the params' ``device`` (``capturable=True`` steps nowhere else).

    Raises:
        ValueError: as :func:`state_spec`, or the class keeps scalar state other than ``step`` (e.g. NAdam's ``mu_product``),
            which zeroshard checkpoints do not carry.
    """
    spec = state_spec(optimizer, hyperparameters, (2,), dtype, (device,))
    if scalars := sorted(k for k, shape in spec.shapes.items() if shape != (2,)):
        raise ValueError(f"{type(optimizer).__name__} keeps scalar state {scalars}; zeroshard checkpoints carry per-element state and 'step' only")
    return list(spec.shapes), spec.has_step
