"""A ``DistributedDataParallel`` wrapped around params that zeroshard reduces: checked, its reducer released and given back.

See ``docs/design.md``, "What user code does to the params and gradients" ("The model is also wrapped in
DistributedDataParallel"). Switched off (``require_backward_grad_sync = False``), DDP's C++ reducer still holds what its
constructor (``_ddp_init_helper``) built: an autograd hook per param and bucket buffers as large as the params (``4Ψ``
bytes in fp32; on a GPU from construction, on the CPU once DDP reduced a backward, and kept for good with
``find_unused_parameters=True``, HF Trainer's default). That erases most of stage 2's saving (``4Ψ + 12Ψ/N`` bytes per rank
against DDP's ``16Ψ``), so while zeroshard owns the params the reducer is released; on close DDP gets a new one, built as its
``__setstate__`` builds one. Source: ``torch/nn/parallel/distributed.py`` of torch 2.4 to 2.13. DDP options zeroshard
cannot follow raise :class:`RuntimeError` naming the option when the wrapper is found (:func:`check_supported`).
"""

from __future__ import annotations

import gc
import inspect
import logging
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# DDP's private methods a reducer is rebuilt with, with the parameters they take (torch >= 2.4).
_REBUILD_API = {
    "_build_params_for_reducer": [],
    "_build_debug_param_to_name_mapping": ["parameters"],
    "_ddp_init_helper": ["parameters", "expect_sparse_gradient", "param_to_name_mapping", "static_graph"],
}
logger = logging.getLogger("zeroshard")
_WAY_OUT = "or drop the DistributedDataParallel wrapper (zeroshard reduces the gradients itself)"


class _Refusing:
    """A stand-in for ``ddp.<_name>``: anything it does not define raises a ``RuntimeError`` saying why and what to do."""

    _name = ""

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("__", "_pybind11")):  # Python's and pybind11's protocols
            raise AttributeError(name)
        raise RuntimeError(
            f"DistributedDataParallel.{self._name}.{name}: DDP's reducer is released while a zeroshard ShardedOptimizer reduces the "
            "gradients of the wrapped params (a second reduction by DDP would send every gradient twice). Call opt.close() "
            f"first to give DDP its reducer back, {_WAY_OUT}"
        )


class ReleasedReducer(_Refusing):
    """Stands in for ``ddp.reducer`` while zeroshard reduces the gradients of the wrapped params.

    DDP's forward calls ``_rebuild_buckets()`` (``False``: nothing to rebuild); Lightning's manual optimization and
    accelerate's ``trigger_sync_in_backward`` call ``prepare_for_backward`` (reduce the coming backward even after a
    ``no_sync()`` forward), passed on to zeroshard. ``comm_hooks`` (DDP's ``_comm_hooks``) and ``builtin_hook`` are the
    released reducer's communication hooks, registered again on the reducer given back.
    """

    _name = "reducer"

    def __init__(self, comm_hooks: list[tuple[Callable, Any]], builtin_hook: Any) -> None:
        self.comm_hooks = comm_hooks
        self.builtin_hook = builtin_hook
        # Per DDPWrappers holding the release (by id; one per optimizer): its sync_next_backward. The last one gives DDP a reducer back.
        self.holders: dict[int, Callable[[], None]] = {}

    def _rebuild_buckets(self) -> bool:
        return False

    def prepare_for_backward(self, outputs: Any = None) -> None:
        for sync_next_backward in list(self.holders.values()):
            sync_next_backward()

    def _remove_autograd_hooks(self) -> None:  # removed when released
        pass


class ReleasedLogger(_Refusing):
    """Stands in for ``ddp.logger`` (which holds the reducer) while the reducer is released: ``_get_ddp_logging_data()`` answers
    with what DDP's logger held (Lightning reads it at teardown); ``set_error_and_log`` does nothing (DDP raises right after)."""

    _name = "logger"

    def __init__(self, logging_data: Any) -> None:
        self._logging_data = logging_data

    def _get_ddp_logging_data(self) -> Any:
        return self._logging_data

    def set_error_and_log(self, message: str) -> None:
        pass

    def set_runtime_stats_and_log(self) -> None:
        """DDP's forward calls it only when set to reduce the coming backward, which zeroshard's forward pre-hook turns off."""
        raise RuntimeError(
            "DistributedDataParallel.forward ran without its forward hooks (ddp.forward(x) called directly?): zeroshard reduces "
            "the gradients of the wrapped params and turns DDP's reduction off in a forward pre-hook before each forward; call "
            f"ddp(x), {_WAY_OUT}")


@dataclass
class WrappedDDP:
    """One DDP wrapper around one optimizer's params."""

    ddp: weakref.ref  # the wrapper
    released: bool = False  # this optimizer holds the release of ``ddp``'s reducer (a :class:`ReleasedReducer` now)
    covered: bool = False  # every param it reduces is some optimizer's (DDPWrappers.check_covered)


def _hooks_to_register_again(ddp: nn.Module) -> tuple[list[tuple[Callable, Any]], Any]:
    """The Python communication hooks (DDP's ``_comm_hooks``) and the built-in one registered on ``ddp``'s reducer.

    Raises:
        RuntimeError: a hook is registered that is neither (DDP records only its name).
    """
    python_hooks = list(getattr(ddp, "_comm_hooks", []))
    logger_ = getattr(ddp, "logger", None)
    name = logger_._get_ddp_logging_data().strs_map.get("comm_hook", "") if logger_ is not None else ""
    if not name or name in {hook.__qualname__ for hook, _ in python_hooks}:
        return python_hooks, None
    builtin = getattr(dist.BuiltinCommHookType, name.removeprefix("BuiltinCommHookType."), None) if name.startswith("BuiltinCommHookType.") else None
    if builtin is None:
        raise RuntimeError(f"DistributedDataParallel has the communication hook {name!r}, which zeroshard cannot register again "
                           f"when it gives DDP its reducer back (torch {torch.__version__} does not record it): {_WAY_OUT}")
    return python_hooks, builtin


def check_supported(ddp: nn.Module) -> None:
    """Check that zeroshard can switch ``ddp``'s reduction off, release its reducer and give it back.

    Raises:
        RuntimeError: naming the DDP option zeroshard cannot follow (and why), a communication hook that cannot be
            registered again, or a torch whose DDP lacks the private methods a reducer is rebuilt with.
    """
    if getattr(ddp, "mixed_precision", None) is not None:
        raise RuntimeError("DistributedDataParallel(mixed_precision=...) casts the params itself, which zeroshard cannot follow: use bf16 params "
                           f"or autocast, {_WAY_OUT}")
    if getattr(ddp, "_delay_all_reduce_params", None):
        raise RuntimeError("DistributedDataParallel(delay_all_reduce_named_params=...) all-reduces those params' gradients in a hook "
                           f"that zeroshard cannot switch off (a second reduction): leave the option out, {_WAY_OUT}")
    if getattr(ddp, "_use_python_reducer", False):
        raise RuntimeError("DistributedDataParallel under torch._dynamo.config.optimize_ddp='python_reducer' all-reduces in hooks "
                           f"that zeroshard cannot switch off (a second reduction): use another optimize_ddp mode, {_WAY_OUT}")
    for name, parameters in _REBUILD_API.items():
        method = getattr(ddp, name, None)
        if method is None or list(inspect.signature(method).parameters) != parameters:
            raise RuntimeError(f"zeroshard cannot release and rebuild DDP's reducer on torch {torch.__version__}: "
                               f"DistributedDataParallel.{name} is missing or takes other arguments than ({', '.join(parameters)}) "
                               f"as in torch 2.4 to 2.13; {_WAY_OUT}")
    if not callable(getattr(getattr(ddp, "reducer", None), "_remove_autograd_hooks", None)):  # torch >= 2.1
        raise RuntimeError(f"zeroshard cannot release DDP's reducer on torch {torch.__version__}: it has no _remove_autograd_hooks; {_WAY_OUT}")
    _hooks_to_register_again(ddp)


def release_reducer(wrapped: WrappedDDP, holder: int, sync_next_backward: Callable[[], None]) -> None:
    """Free the wrapper's reducer (its bucket buffers and autograd hooks) for ``holder``, or add ``holder`` to those of a released one.

    Only between backward passes: a reducer mid-backward has queued a callback on itself. With ``static_graph=True`` DDP's
    first-iteration delayed all-reduce is marked done, so its forward does not queue one on the released reducer.
    """
    ddp = wrapped.ddp()
    if ddp is None or wrapped.released:
        return
    if not isinstance(ddp.reducer, ReleasedReducer):
        comm_hooks, builtin_hook = _hooks_to_register_again(ddp)
        logging_data = ddp.logger._get_ddp_logging_data() if ddp.logger is not None else None
        ddp.reducer._remove_autograd_hooks()
        ddp.reducer = ReleasedReducer(comm_hooks, builtin_hook)
        ddp.logger = ReleasedLogger(logging_data)
        if ddp.static_graph:
            ddp._static_graph_delay_allreduce_enqueued = True
    ddp.reducer.holders[holder] = sync_next_backward
    wrapped.released = True


def give_back_reducer(wrapped: WrappedDDP, holder: int) -> None:
    """``holder`` lets go of the wrapper's reducer; the last one builds DDP a new reducer, as ``DistributedDataParallel.__setstate__``
    does, with the released one's static graph and communication hooks (no collective; buckets rebuilt after its first iteration)."""
    ddp = wrapped.ddp()
    if ddp is None or not wrapped.released:
        return
    wrapped.released = False
    released = ddp.reducer
    if not isinstance(released, ReleasedReducer):  # replaced by someone else meanwhile
        return
    released.holders.pop(holder, None)
    if released.holders:
        logger.warning("zeroshard: DDP's reducer stays released while another ShardedOptimizer reduces params of the same "
                       "DistributedDataParallel: the gradients of this optimizer's params are reduced by no one until it is closed too")
        return
    parameters, expect_sparse_gradient = ddp._build_params_for_reducer()
    param_to_name_mapping = ddp._build_debug_param_to_name_mapping(parameters)
    ddp._ddp_init_helper(parameters, expect_sparse_gradient, param_to_name_mapping, ddp.static_graph)
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
        ddp._static_graph_delay_allreduce_enqueued = False
    for hook, state in released.comm_hooks:
        ddp.logger._set_comm_hook_name(hook.__qualname__)
        dist._register_comm_hook(ddp.reducer, state, hook)
    if released.builtin_hook is not None:
        ddp.logger._set_comm_hook_name(str(released.builtin_hook))
        dist._register_builtin_comm_hook(ddp.reducer, released.builtin_hook)
    ddp._has_rebuilt_buckets = False


def find_wrappers(params: Iterable[nn.Parameter]) -> list[nn.Module]:
    """Every ``DistributedDataParallel`` alive now whose module has one of ``params``, also those built before zeroshard was
    imported or by ``copy.deepcopy``/unpickling, which no registration hook sees: ``gc.get_referrers`` of the DDP classes is
    one pass in C over the tracked objects, about 5x faster than a Python loop over ``gc.get_objects()``."""
    ours = {id(p) for p in params}
    ddp_types = _subclasses(DistributedDataParallel)
    # type(), not isinstance(): that raises ReferenceError on a dead weakref.proxy (torch.compile leaves some).
    wrappers = [obj for obj in gc.get_referrers(*ddp_types) if type(obj) in ddp_types]
    return [ddp for ddp in wrappers if isinstance(module := getattr(ddp, "module", None), nn.Module)
            and any(id(p) in ours for p in module.parameters())]


def _subclasses(cls: type) -> set[type]:
    """``cls`` and its subclasses defined so far, at any depth."""
    return {cls}.union(*map(_subclasses, cls.__subclasses__()))


def _restore_sync(ddp: Any, args: object, output: object) -> None:  # Any: DDP, with zeroshard's attributes set on it
    """A forward hook on a DDP wrapper: ``require_backward_grad_sync`` gets back the value the forward started with, and
    ``require_forward_param_sync`` (the next forward broadcasts rank 0's buffers) is set as DDP's ``_post_forward`` sets it."""
    ddp.require_backward_grad_sync = ddp._zeroshard_sync
    ddp.require_forward_param_sync = torch.is_grad_enabled() and ddp._zeroshard_sync
    ddp._zeroshard_in_forward = False


class DDPWrappers:
    """The ``DistributedDataParallel`` wrappers around one ``GradReducer``'s params, switched off while it reduces.

    A forward pre-hook turns DDP's gradient sync off before every forward of a wrapper and a forward hook restores it
    (:func:`_restore_sync`); the reducer is released between backward passes and given back by :meth:`close`.
    ``on_forward(no_sync)`` is called before each forward (under ``ddp.no_sync()``, the next backward accumulates locally),
    ``sync_next_backward`` when a framework asks a released reducer to reduce the coming backward; both must hold the
    ``GradReducer`` weakly (the wrappers' hooks hold this object).
    """

    def __init__(self, on_forward: Callable[[bool], None], sync_next_backward: Callable[[], None]) -> None:
        self._on_forward = on_forward
        self._sync_next_backward = sync_next_backward
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self.wrapped: list[WrappedDDP] = []  # adopted so far
        self.new: list[weakref.ref] = []  # built since the last backward began (watch_new_wrappers), adopted at the next one

    def adopt(self, candidates: Iterable[nn.Module]) -> list[bool]:
        """Switch off the gradient reduction of each wrapper in ``candidates`` not adopted yet (logged once).

        Both reducing would send every gradient twice. A wrapper that ran a forward before any hook saw it is adopted at
        the next backward, which DDP's forward prepared already: what DDP writes into ``.grad`` until the next step is
        ignored, and its reducer is released at the wrapper's next forward or ``step()``.

        Returns, per wrapper adopted now, whether its last forward prepared DDP's reducer to reduce the coming backward
        (``require_forward_param_sync``: off inside ``ddp.no_sync()``); none for a wrapper that ran no forward yet. Raises
        ``RuntimeError`` from :func:`check_supported`, before any wrapper is changed.
        """
        known = {id(w.ddp()) for w in self.wrapped}
        wrappers: list[Any] = list({id(ddp): ddp for ddp in candidates if id(ddp) not in known}.values())
        for ddp in wrappers:
            check_supported(ddp)
        syncs = []
        for ddp in wrappers:
            if not getattr(ddp, "_zeroshard_in_forward", False):  # for _restore_sync, if adopted inside a forward
                ddp._zeroshard_sync = ddp.require_backward_grad_sync
            self._hooks.append(ddp.register_forward_pre_hook(self._pre_forward))
            self._hooks.append(ddp.register_forward_hook(_restore_sync, always_call=True))
            self.wrapped.append(WrappedDDP(weakref.ref(ddp)))
            if getattr(ddp, "_lazy_init_ran", True):
                syncs.append(ddp.require_forward_param_sync)
            else:  # no forward prepared its reducer (which a shallow copy sharing it may have released: accelerate's
                # compile_regions keeps the original beside the copy it runs): no say, and released at once, also mid-backward
                release_reducer(self.wrapped[-1], id(self), self._sync_next_backward)
        if wrappers and dist.get_rank() == 0:
            logger.info("zeroshard: the model is wrapped in DistributedDataParallel; zeroshard reduces its gradients itself, so DDP's "
                        "gradient reduction is switched off")
        return syncs

    def adopt_new(self) -> list[bool]:
        """At a backward's first gradient: :meth:`adopt` the wrappers built since the last backward began (what it returns; its ``RuntimeError``)."""
        if not self.new:
            return []
        syncs = self.adopt([ddp for ref in self.new if (ddp := ref()) is not None])
        self.new.clear()
        return syncs

    def adopt_at_first_forward(self, ddp: nn.Module, args: object) -> None:
        """Adopt ``ddp``, built after the optimizer, before its first forward prepares DDP's reducer: DDP reduces no backward.

        Raises:
            RuntimeError: from :func:`check_supported`.
        """
        if not any(ref() is ddp for ref in self.new):
            return
        self.new[:] = [ref for ref in self.new if ref() is not None and ref() is not ddp]
        self.adopt([ddp])
        self._pre_forward(ddp, args)

    def _pre_forward(self, ddp: Any, args: object) -> None:
        # Under ``ddp.no_sync()`` (gradient accumulation) zeroshard accumulates without communication too; either way
        # DDP's reducer sits this forward's backward out. The first of several optimizers' pre-hooks (each over other
        # params) reads the switch.
        if not getattr(ddp, "_zeroshard_in_forward", False):
            ddp._zeroshard_sync, ddp._zeroshard_in_forward = ddp.require_backward_grad_sync, True
        self._on_forward(not ddp._zeroshard_sync)
        self.release()  # the backward a wrapper found at a backward still reduced is over
        ddp.require_backward_grad_sync = False

    def release(self) -> None:
        """Release every adopted wrapper's reducer (:func:`release_reducer`); only between backward passes."""
        for wrapped in self.wrapped:
            release_reducer(wrapped, id(self), self._sync_next_backward)

    def check_covered(self, owned: Callable[[nn.Parameter], bool]) -> None:
        """Raise ``RuntimeError`` naming them if a wrapper reduces trainable params that no ``ShardedOptimizer`` reduces
        (``owned``): with DDP's reduction off nothing would average their gradients, so a clip over the model would read each
        rank's own and an optimizer over them would let the ranks drift apart. Once per wrapper, at the end of the first
        backward reduced after its adoption (every optimizer built by then), alike on every rank."""
        for wrapped in self.wrapped:
            ddp = wrapped.ddp()
            if ddp is None or wrapped.covered:
                continue
            ignored = getattr(ddp, "parameters_to_ignore", ())
            missing = [name for name, p in ddp.module.named_parameters() if p.requires_grad and p.numel() and name not in ignored and not owned(p)]
            if missing:
                raise RuntimeError(
                    f"DistributedDataParallel wraps {len(missing)} trainable param(s) that no ShardedOptimizer holds ({missing[:5]}): zeroshard "
                    "switches DDP's gradient reduction off, so nothing would average their gradients (a clip over the model would read "
                    "each rank's own, a plain optimizer over them would let the ranks drift apart). Put them in a ShardedOptimizer (a "
                    "second one for another optimizer) or freeze them (requires_grad_(False))")
            wrapped.covered = True

    def close(self) -> None:
        """Remove the hooks and give every wrapper its reducer back: DDP reduces again from its next forward (idempotent)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        wrapped, self.wrapped = self.wrapped, []
        self.new.clear()
        for w in wrapped:
            give_back_reducer(w, id(self))


_WATCHING: list[torch.utils.hooks.RemovableHandle] = []  # the process's one module registration hook


def watch_new_wrappers(wrappers_of_owners: Callable[[Iterable[nn.Parameter]], list[DDPWrappers]]) -> None:
    """Note every ``DistributedDataParallel`` built from now on with the :class:`DDPWrappers` of its params' owners.

    One global module registration hook per process: DDP's constructor sets ``self.module`` first, so the wrapper goes
    into ``new`` of each ``DDPWrappers`` that ``wrappers_of_owners`` returns, and a one-shot forward pre-hook adopts it
    before its first forward (else the next backward does). One string comparison per submodule registered anywhere,
    where looking at every backward would cost a pass over every object the garbage collector tracks.
    """
    if _WATCHING:
        return

    def note(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
        if name == "module" and isinstance(module, DistributedDataParallel) and submodule is not None:
            owners = wrappers_of_owners(submodule.parameters())
            for wrappers in owners:
                wrappers.new.append(weakref.ref(module))
            if owners:  # adopted at its first forward, before DDP's own forward prepares its reducer
                handle: list[torch.utils.hooks.RemovableHandle] = []

                def adopt(ddp: nn.Module, args: object) -> None:
                    handle.pop().remove()
                    for wrappers in wrappers_of_owners(submodule.parameters()):
                        wrappers.adopt_at_first_forward(ddp, args)

                handle.append(module.register_forward_pre_hook(adopt))

    _WATCHING.append(nn.modules.module.register_module_module_registration_hook(note))


def release(handles: list[torch.utils.hooks.RemovableHandle], ddps: DDPWrappers) -> None:
    """Remove a reducer's hooks and give each DDP wrapper it silenced its reducer and its gradient reduction back."""
    for handle in handles:
        handle.remove()
    handles.clear()
    ddps.close()
