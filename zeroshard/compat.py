"""The private torch internals zeroshard uses, in one place, each with the reason no public API serves.

``tests/test_compat.py`` checks every one against the installed torch and fails naming the torch
version when one is gone or behaves otherwise; ``pyproject.toml`` states the torch releases the suite
ran on. ``DistributedDataParallel``'s private members, which zeroshard needs to switch DDP's own
reduction off, stay with that surgery in ``zeroshard/reduce/ddp.py``, whose ``check_supported``
raises naming the torch version before anything is changed.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack, _pop_mode, _push_mode

# param_gather.py: the gather guard sits on the torch-function mode stack only while all-gathers are
# in flight; a ``with mode:`` block cannot outlive ``step()``, so it pushes and pops by hand.
function_mode_stack = _get_current_function_mode_stack
push_function_mode = _push_mode
pop_function_mode = _pop_mode

# A tensor subclass's own attributes and ops without a Python ``__torch_function__`` call each (torch's
# documented idiom for subclasses, "Extending torch with a Tensor-like type"), and with no mode at all.
DisableTorchFunctionSubclass = torch._C.DisableTorchFunctionSubclass
DisableTorchFunction = torch._C.DisableTorchFunction

# partial_norm.py, sharded_grad.py: a tensor subclass instance viewing an existing tensor's storage (no copy), as
# torch's own subclasses (``nn.Parameter``, ``Buffer``) are made; ``Tensor.as_subclass`` runs ``__torch_function__``.
make_subclass = torch.Tensor._make_subclass

# fused_adam.py: the kernels ``AdamW(fused=True).step()`` runs, called on a chunk's flat tensors with the
# multiplier folded in (``torch.optim`` exposes them only through ``step()`` on its own params).
fused_adamw_ = torch._fused_adamw_
fused_adam_ = torch._fused_adam_
foreach_mul_ = torch._foreach_mul_
foreach_copy_ = torch._foreach_copy_
# sharded_grad.py: the norm ``clip_grad_norm_(foreach=True)`` takes of DDP's gradient, taken of a whole gradient alike.
foreach_norm = torch._foreach_norm

# ``Tensor._version``, the version counter autograd checks saved tensors with, read directly where a
# write must be noticed (an attribute read on the per-param hot path, so not wrapped here):
# layout/local_shard.py (a param written outside the optimizer: its master is refreshed),
# grad/shard_grads.py and reduce/records.py (user code that wrote a ``.grad``, or its flat grad
# buffer through a view). They rely on: every in-place write bumps it, a view shares its base's
# counter, a param bound with ``p.data = flat_view`` keeps a counter of its own (the optimizer's
# writes to the flat buffer do not move it), and autograd's accumulation into ``.grad`` bumps it.

# DelegatingOptimizer: the hook registries ``torch.optim.Optimizer.__init__`` creates, which its public
# ``register_step_pre_hook`` and friends fill; a ShardedOptimizer does not run that ``__init__``.

OPTIMIZER_HOOK_DICTS = (
    "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks",
)


class DelegatingOptimizer(torch.optim.Optimizer):
    """An optimizer that owns no params: ``param_groups``, ``state`` and ``defaults`` are ``optimizer``'s live objects, which LR
    schedulers, ``register_step_pre_hook`` and code reading ``opt.param_groups`` / ``opt.state`` see (as with
    ``torch.distributed.optim.ZeroRedundancyOptimizer``'s ``optim``; ``ShardedOptimizer`` is one).

    Sets up what ``torch.optim.Optimizer.__init__`` sets up for hooks (the step and state-dict hook registries that
    ``register_step_pre_hook`` and friends use, and torch's profiling wrapper around ``step``) without taking params.

    Args:
        optimizer: the wrapped ``torch.optim.Optimizer`` (``self.optimizer``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:  # not torch's __init__, which takes params
        self.optimizer = optimizer
        for name in OPTIMIZER_HOOK_DICTS:
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's live ``param_groups`` (a ``ShardedOptimizer``'s hold virtual parameters)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        """The wrapped optimizer's state (a ``ShardedOptimizer``'s: keyed by virtual parameter, this rank's shard only)."""
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's ``defaults``."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value


def current_autograd_node() -> Any:
    """The autograd node whose task is running on this thread, or ``None`` outside one.

    OutermostBackward (reduce/records.py): a backward started inside another's hook ends before the enclosing one; this
    node is how its end is handed to the enclosing pass (``torch._C._current_autograd_node``).
    """
    return torch._C._current_autograd_node()


# The id of the autograd graph task (one ``backward()`` or ``autograd.grad()`` call) running on this thread; ids are not
# reused (-1 outside one). grad_reducer.py: a backward pass's first gradient, read in every param's pre-hook (so bound
# directly, without a Python frame of ours).
current_graph_task: Callable[[], int] = torch._C._current_graph_task_id


_ACCUMULATES: dict[int, bool] = {}  # graph task id -> whether it accumulates into .grad (accumulates_into_grad)


def accumulates_into_grad(param: nn.Parameter, task: int) -> bool:
    """In ``param``'s tensor pre-hook: whether the running backward accumulates into ``.grad``.

    ``torch.autograd.grad(outputs, params)`` runs the params' tensor pre-hooks too but leaves ``.grad``
    alone (as ``backward(inputs=...)`` does for the params it leaves out, whose hooks do not run).
    grad_reducer.py: its pre-hook changes ``.grad`` only where autograd will then accumulate.
    ``torch._C._will_engine_execute_node`` answers for a param's grad accumulator in ``backward()``
    and refuses (``RuntimeError``) inside ``torch.autograd.grad``: either way it tells the two
    apart. Asked once per graph task (``task``: the caller's :func:`current_graph_task`).
    """
    found = _ACCUMULATES.get(task)
    if found is None:
        try:
            found = bool(torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(param).node))
        except RuntimeError:  # "... we are currently running autograd.grad()"
            found = False
        if len(_ACCUMULATES) > 64:  # finished tasks: their ids are not reused
            _ACCUMULATES.clear()
        _ACCUMULATES[task] = found
    return found


def post_accumulate_grad_hook_ids(param: nn.Parameter) -> list[int]:
    """The handle ids of the post-accumulate-grad hooks registered on ``param``, in registration order.

    shard_grads.py: whether a user's hook was registered before zeroshard's (it then ran first, on this
    rank's gradient); ``Tensor.register_post_accumulate_grad_hook`` returns handles but no registry.
    """
    return list(getattr(param, "_post_accumulate_grad_hooks", None) or {})


def last_post_accumulate_grad_hook_id(param: nn.Parameter) -> int | None:
    """The handle id of the post-accumulate-grad hook registered last on ``param`` (it runs last), or ``None``.

    grad_reducer.py: a gradient is taken at once when no hook runs after zeroshard's (one dict read per gradient).
    """
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    return next(reversed(hooks)) if hooks else None


def compiling() -> bool:
    """Whether Dynamo is compiling a frame, also in the Python it runs itself (``torch.compiler.is_compiling()`` is ``True`` only
    in the code it traces).

    sharded_grad.py: making a param a fake tensor, Dynamo describes its ``.grad``'s storage, which is metadata there.
    """
    from torch._guards import TracingContext  # on use, as torch._dynamo imports it

    return TracingContext.try_get() is not None


def compiled_module(module: nn.Module) -> bool:
    """Whether calling ``module`` runs Dynamo-compiled code: ``torch.compile(module)``'s wrapper, or a module whose ``compile()`` ran.

    param_gather.py: compiled code cannot wait for a gather inside its frame, so the guard waits before such a call and leaves
    the mode stack; torch names neither the wrapper class nor the compiled call publicly.
    """
    if getattr(module, "_compiled_call_impl", None) is not None:
        return True
    dynamo = sys.modules.get("torch._dynamo")  # not imported: nothing was compiled
    return dynamo is not None and isinstance(module, dynamo.eval_frame.OptimizedModule)


def step_with_own_hooks(optimizer: torch.optim.Optimizer, update: Callable[[], None] | None = None) -> None:
    """Run ``update`` (``None``: ``optimizer``'s own step) as ``optimizer.step()`` runs — under the profiler's
    ``Optimizer.step#<class>.step`` label, with the step pre- and post-hooks registered on ``optimizer``
    (``register_step_pre_hook``; a pre hook's ``(args, kwargs)`` are passed on) — but not torch's global hooks
    (``torch.optim.optimizer.register_optimizer_step_pre_hook``), which ran once around the ShardedOptimizer's ``step``;
    then :func:`note_step`. A ``step`` patched on the instance (but by an LR scheduler around the class's own, which only
    marks the step) is called as it is, its class's wrapper and global hooks included.

    update.py and step/wrapped.py: torch's wrapper around every optimizer class's ``step`` (``Optimizer.profile_hook_step``,
    marked ``hooked``; the function under it is its ``__wrapped__``) runs both kinds together, and the registries are private.

    Raises:
        RuntimeError: a pre hook returned something other than ``None`` or ``(args, kwargs)``, as torch's wrapper raises.
    """
    patched = vars(optimizer).get("step")
    # an LR scheduler's patch around the class's step only marks the step (note_step); around another patch, it is a patch
    marks_only = getattr(patched, "_wrapped_by_lr_sched", False) and getattr(patched, "__wrapped__", None) is type(optimizer).step
    if update is None and patched is not None and not marks_only:
        patched()
        note_step(optimizer)
        return
    args: tuple[Any, ...] = (optimizer,)
    kwargs: dict[str, Any] = {}
    with torch.autograd.profiler.record_function(f"Optimizer.step#{type(optimizer).__name__}.step"):
        for pre_hook in list(optimizer._optimizer_step_pre_hooks.values()):
            result = pre_hook(optimizer, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"{pre_hook} must return None or a tuple of (new_args, new_kwargs), but got {result}")
                args, kwargs = result
        if update is not None:
            update()
        else:
            step = type(optimizer).step
            (step.__wrapped__ if getattr(step, "hooked", False) else step)(*args, **kwargs)  # type: ignore[attr-defined]
        for post_hook in list(optimizer._optimizer_step_post_hooks.values()):
            post_hook(optimizer, args, kwargs)
    note_step(optimizer)


def note_step(optimizer: torch.optim.Optimizer) -> None:
    """Record on ``optimizer`` that its step ran, as the ``step`` wrapper a ``torch.optim.lr_scheduler.LRScheduler`` built on
    it records (``optimizer._opt_called``), so that the scheduler does not warn that its ``step()`` came first.

    update.py: the fused update steps the wrapped optimizer's state without calling its ``step()``; no public API marks a step.
    """
    optimizer._opt_called = True  # type: ignore[attr-defined]


def load_checkpoint_without_process_group(state: dict[str, Any], checkpoint: str) -> None:
    """Fill ``state`` with everything in the DCP checkpoint directory ``checkpoint``, on one process, with no process group.

    convert.py: ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` does the same but writes
    the result to a file; its loader and planner are private.

    Raises:
        CheckpointException, Exception: what DCP raises for a missing or damaged file.
    """
    from torch.distributed.checkpoint import FileSystemReader  # on use: `import zeroshard` stays free of DCP (and sympy)
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _load_state_dict(state, storage_reader=FileSystemReader(checkpoint), planner=_EmptyStateDictLoadPlanner(), no_dist=True)

