"""The all-gather of updated params after ``step()``, overlapped with whatever runs next (the next forward).

See "One step" in ``docs/design.md`` (buckets gathered in forward order; on CUDA each waited for just before the first
torch function that touches one of its params, as Megatron-LM's ``overlap_param_gather``; where a wait blocks the host,
all at the first touch) and "Reading params after ``step()``" in ``docs/api.md`` (what the guard covers, its cost).

Why a ``TorchFunctionMode`` rather than Megatron's forward pre-hooks on the modules: the optimizer is given params, not
modules, and a param can be read outside any forward (an EMA copy, ``model.state_dict()``, ``p.clone()``). Every such read
goes through a torch function (``Tensor`` methods, ``torch.ops`` custom ops, ``torch.compile``, whose Dynamo honours
active modes), which :class:`_ParamGuard` sees first: nothing reads a param half-gathered, a silent wrong number.
"""

from __future__ import annotations

import datetime
import functools
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.overrides import TorchFunctionMode

from zeroshard.comm import collectives
from zeroshard.compat import compiled_module, function_mode_stack, pop_function_mode, push_function_mode
from zeroshard.layout.local_shard import LocalShard


@dataclass(eq=False)
class BucketGather:
    """One bucket's all-gather in flight."""

    work: collectives.AsyncWork
    params: tuple[nn.Parameter, ...]  # the model params whose values the gather completes
    stream: torch.cuda.Stream | None = None  # on CUDA, the stream current at launch (step()'s, which the next forward runs on)


_use_stream = torch.cuda.stream  # a context in which ``stream`` is the current CUDA stream


def _current_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The current CUDA stream of ``device``; ``None`` off CUDA (waits there block the host)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


class ParamGather:
    """One optimizer's param all-gathers over the shard group ``group``: launched at the end of ``step()``, waited for in launch order.

    ``timeout`` bounds each wait (:func:`zeroshard.comm.collectives.wait`; ``None``: the group's). With ``overlap`` the
    gathers stay in flight when ``step()`` returns, guarded; without it :meth:`launch` waits for them.
    """

    def __init__(self, group: ProcessGroup, timeout: datetime.timedelta | None, overlap: bool) -> None:
        self.group = group
        self.timeout = timeout
        self.overlap = overlap
        self._pending: list[BucketGather] = []  # in launch order; earlier ones complete first
        self._unsettled: list[BucketGather] = []  # waited for on another CUDA stream than their launch stream only: still guarded (_settle)

    @property
    def pending(self) -> int:
        """How many bucket all-gathers are in flight, or not yet waited for on their launch stream."""
        return len(self._pending) + len(self._unsettled)

    @functools.cached_property
    def size(self) -> int:
        """The shard group's size, read once (see :attr:`~zeroshard.comm.groups.ShardingGroups.shard_size`)."""
        return dist.get_world_size(self.group)

    def launch(self, shards: list[LocalShard]) -> None:
        """All-gather each chunk's ``params`` (this rank's updated slice) of ``shards`` into its ``bucket_params``, last bucket first
        (forward order); waits for them unless ``overlap`` is on and the guard could be pushed (only onto an empty mode stack)."""
        self.wait()  # a param is written only after every earlier gather into it is done
        if self.size == 1:
            return  # a shard group of one: the params are already complete, nothing to guard
        for owner, chunk in reversed([(shard, chunk) for shard in shards for chunk in shard.chunks]):
            work = collectives.all_gather(chunk.bucket_params, chunk.params, self.group)
            bucket_params = tuple(owner.buffer.params[i] for i in owner.buffer.layout.buckets[chunk.bucket].params)
            self._pending.append(BucketGather(work, bucket_params, _current_stream(chunk.params.device)))
        if not (self.overlap and _GUARD.watch(self)):
            self.wait()

    def drop_completed(self) -> None:
        """Retire the gathers at the front that have completed by themselves (never blocks)."""
        while self._pending and self._pending[0].work.is_completed():
            self.wait(upto=self._pending[0])
        for gather in [g for g in self._unsettled if g.work.is_completed()]:
            self._unsettled.remove(gather)
            _GUARD.forget(gather)

    def wait_for(self, gather: BucketGather) -> None:
        """Wait before a read of ``gather``'s params: on CUDA for it and those before it (a wait orders the stream); where a wait
        blocks the host, for every gather, so the guard can go at the next module call, not at the last param's first read."""
        self.wait(upto=gather if gather.stream is not None else None)

    def wait(self, upto: BucketGather | None = None) -> None:
        """Wait for the pending gathers in launch order, through ``upto`` (``None``: all of them, and the unsettled ones again).

        On CUDA a wait orders the *current* stream after the gather (NCCL's ``work.wait()`` does not block the host). One
        waited for on another stream than its launch stream (an EMA under ``torch.cuda.stream(s)``) stays guarded until a
        wait on its launch stream or its completion, so the next forward waits too.

        Raises:
            RuntimeError: with a ``timeout``, a gather some rank did not join in time (named).
        """
        if upto is not None and any(g is upto for g in self._unsettled):
            self._settle(upto)
            return
        while self._pending:
            gather = self._pending.pop(0)
            self._unsettled.append(gather)
            self._settle(gather)
            if gather is upto:
                return
        for gather in list(self._unsettled):
            self._settle(gather)

    def settle_all(self) -> None:
        """Wait for every gather on the current stream and, one waited for on another stream only, on its launch stream too
        (CUDA): nothing stays guarded."""
        self.wait()
        for gather in list(self._unsettled):
            with _use_stream(gather.stream):
                self._settle(gather)

    def _settle(self, gather: BucketGather) -> None:
        """Wait for an unsettled gather on the current stream; drop it from the guard if that settles it."""
        # The params must hold every rank's update before anything reads or writes them.
        collectives.wait(gather.work, self.timeout, "the all-gather of the updated params (waited for before a param was read)", "call step() on every rank")
        # Settled, needing no more waits: off CUDA, completed, or waited for on its launch stream.
        if gather.stream is None or gather.work.is_completed() or _current_stream(gather.stream.device) == gather.stream:
            self._unsettled.remove(gather)
            _GUARD.forget(gather)


# Dynamo cannot trace a wait on a c10d work: the waits run outside compiled frames (a graph break, or this reason under fullgraph).
_COMPILED = ("zeroshard: the last step()'s param all-gather is in flight and compiled code cannot wait for it; call "
             "opt.wait_params() before a torch.compile(fullgraph=True) function, compile the model itself (torch.compile(model), "
             "model.compile(): its hooks run before the compiled frame), or pass overlap_param_gather=False")


def _wait_for(entry: tuple[ParamGather, BucketGather]) -> None:
    entry[0].wait_for(entry[1])


def _wait_all(guard: _ParamGuard) -> None:
    for gathers in list(guard._gathers.values()):
        gathers.settle_all()


def _outside_compiled(fn: Callable) -> Callable:
    """``fn``, made to run outside Dynamo's compiled frames once Dynamo is in use (not before: its import is heavy)."""
    return torch.compiler.disable(fn, reason=_COMPILED) if "torch._dynamo" in sys.modules else fn


class _ParamGuard(TorchFunctionMode):
    """The mode that waits for a param's pending all-gather before any torch function touches it. One per process: every
    optimizer's pending gathers are registered here, so several optimizers (Muon + AdamW) share one mode on the stack."""

    def __init__(self) -> None:
        super().__init__()
        self._waiting: dict[int, tuple[ParamGather, BucketGather]] = {}  # id(param) -> (its optimizer's gathers, its bucket's)
        self._gathers: dict[int, ParamGather] = {}  # id -> the optimizers' gathers with buckets in _waiting
        self._pop_hook: torch.utils.hooks.RemovableHandle | None = None
        self._wait_for: Callable = _wait_for
        self._wait_all: Callable = _wait_all

    def watch(self, gathers: ParamGather) -> bool:
        """Register ``gathers``' pending buckets and push the guard on this thread's mode stack; ``False`` where it cannot be pushed.

        Mode stacks are per thread (and thread ids are reused): already on this thread's stack, it stays; an empty stack
        gets it; under another mode, no push (it would break that mode's exit, a stack pop).
        """
        stack = function_mode_stack()
        if self not in stack:
            if stack:
                return False
            push_function_mode(self)
            self._wait_for, self._wait_all = _outside_compiled(_wait_for), _outside_compiled(_wait_all)
            if self._pop_hook is None:
                self._pop_hook = nn.modules.module.register_module_forward_pre_hook(_outside_compiled(self._before_module_call))
        self._gathers[id(gathers)] = gathers
        for gather in gathers._pending:  # launched, not yet waited for
            for param in gather.params:
                self._waiting[id(param)] = (gathers, gather)
        return True

    def forget(self, gather: BucketGather) -> None:
        """Drop a completed bucket's params from the watch list."""
        for param in gather.params:
            entry = self._waiting.get(id(param))
            if entry is not None and entry[1] is gather:
                del self._waiting[id(param)]

    def pop_if_done(self) -> None:
        """Leave this thread's mode stack once nothing is pending (gathers completed by themselves retired first), if on top of it."""
        for key, gathers in list(self._gathers.items()):
            gathers.drop_completed()
            if not gathers.pending:
                del self._gathers[key]
        if self._waiting:
            return
        stack = function_mode_stack()
        if stack and stack[-1] is self:
            pop_function_mode()
            if self._pop_hook is not None:
                self._pop_hook.remove()
                self._pop_hook = None

    def _before_module_call(self, module: nn.Module, args: object) -> None:
        """Global module forward pre-hook while pushed: wait for a ScriptModule's params, or every gather before a compiled
        module, then pop if done."""
        if isinstance(module, torch.jit.ScriptModule):
            # A scripted or traced module reads its params in C++, past this mode: wait for them now.
            for param in module.parameters():
                entry = self._waiting.get(id(param))
                if entry is not None:
                    _wait_for(entry)
        elif compiled_module(module):
            # Compiled code would break its graph at each wait, and recompile as the mode comes and goes: its frame must start
            # with the guard gone, which takes every gather (of its params or not: a teacher, an EMA model) done.
            _wait_all(self)
        self.pop_if_done()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self._waiting and func not in _METADATA:
            if torch.compiler.is_compiling():  # Dynamo traces this (a compiled function): looking up each argument's id would
                self._wait_all(self)  # tie its code to the batch's identity, a recompile per batch; one graph break instead
                return func(*args, **(kwargs or {}))
            for value in itertools.chain(args, kwargs.values() if kwargs else ()):
                # A param, or a list of them (``_foreach_*``); any other value's id is not in _waiting.
                for item in value if isinstance(value, (list, tuple)) else (value,):
                    entry = self._waiting.get(id(item))
                    if entry is not None:
                        self._wait_for(entry)
        return func(*args, **(kwargs or {}))


def _metadata_functions() -> frozenset:
    """The torch functions that read or set a tensor's metadata, never its values, nor make an alias of it: no wait for them.

    ``model.zero_grad()``, ``p.shape``, a dict keyed by params: the gathers keep overlapping them. Views and ``.data`` are
    not here: an alias made now could be read after the gather without passing through the guard again.
    """
    getters = ("grad", "_grad", "shape", "dtype", "device", "requires_grad", "is_leaf", "_version", "layout", "ndim", "is_cuda",
               "is_sparse", "is_meta", "is_quantized", "grad_fn", "names")
    setters = ("grad", "_grad", "requires_grad")
    methods = ("numel", "nelement", "dim", "size", "stride", "storage_offset", "data_ptr", "element_size", "is_contiguous",
               "get_device", "is_floating_point", "is_complex", "requires_grad_", "retain_grad", "register_hook",
               "register_post_accumulate_grad_hook", "__hash__", "__len__")
    return frozenset(
        [d.__get__ for name in getters if (d := getattr(Tensor, name, None)) is not None]
        + [d.__set__ for name in setters if (d := getattr(Tensor, name, None)) is not None]
        + [f for name in methods if (f := getattr(Tensor, name, None)) is not None]
    )


_METADATA = _metadata_functions()
_GUARD = _ParamGuard()


def pop_guard_if_done() -> None:
    """Take the guard off the mode stack if no gather is pending (called at zeroshard's entry points)."""
    _GUARD.pop_if_done()
