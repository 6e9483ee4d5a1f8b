"""What a ``GradReducer`` holds between hooks (where the step's gradients are, the end of a reentrant checkpoint's nested
backward), and the weak calls its hooks make."""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from zeroshard.compat import current_autograd_node


class StepPhase(enum.Enum):
    """Where a step's gradients are, from one ``reset()`` (``step()``, ``zero_grad()``) to the next."""

    CLEAN = "clean"  # nothing accumulated locally, nothing reduced: no backward yet, or a synced one running
    LOCAL = "local"  # accumulated locally (no_sync), nothing reduced since: .grad holds this rank's own gradients
    REDUCED = "reduced"  # reduced: each .grad is DDP's averaged gradient (a ShardedGrad), nothing accumulated locally since
    REDUCED_THEN_LOCAL = "reduced_then_local"  # reduced, then more accumulated locally (no_sync) or shards added: step() reduces again

    @property
    def after_local(self) -> StepPhase:
        """The phase once more is accumulated locally (a reduction kept, not unsharded)."""
        return StepPhase.REDUCED_THEN_LOCAL if self in REDUCED_ONCE else StepPhase.LOCAL


REDUCED_ONCE = (StepPhase.REDUCED, StepPhase.REDUCED_THEN_LOCAL)  # a backward of this step was reduced
HAS_LOCAL = (StepPhase.LOCAL, StepPhase.REDUCED_THEN_LOCAL)  # accumulated locally since the last reduction (alike on every rank): step() reduces again


def weak_method(method: Callable) -> Callable:
    """``method`` (bound to a GradReducer or an optimizer) called through a weak reference: a no-op (``None``) once its object is gone."""
    ref = weakref.WeakMethod(method)

    def call(*args: object) -> object:
        live = ref()
        return live(*args) if live is not None else None

    return call


def param_hooks(reducer: Any, shard: int, index: int, param: nn.Parameter) -> tuple[Callable, Callable]:
    """The tensor pre-hook and post-accumulate-grad hook of param ``index`` of shard ``shard``, calling ``reducer``'s
    ``before_accumulate`` and ``on_grad_ready``; both hold the reducer and the param weakly (no-ops once either is gone).
    Under ``backward(create_graph=True)`` (grad mode on) they run under ``torch.no_grad()``: values only, as DDP's reducer.
    """
    reducer_ref, param_ref = weakref.ref(reducer), weakref.ref(param)

    def pre_hook(grad: Tensor) -> None:  # before autograd accumulates ``grad`` into ``param.grad``
        live, held = reducer_ref(), param_ref()
        if live is not None and held is not None:
            if torch.is_grad_enabled():  # backward(create_graph=True)
                with torch.no_grad():
                    return live.before_accumulate(shard, index, held, grad)
            live.before_accumulate(shard, index, held, grad)

    def post_hook(held: nn.Parameter) -> None:  # once ``held.grad`` holds the accumulated gradient
        live = reducer_ref()
        if live is not None:
            if torch.is_grad_enabled():
                with torch.no_grad():
                    return live.on_grad_ready(shard, index, held)
            live.on_grad_ready(shard, index, held)

    return pre_hook, post_hook


class OutermostBackward:
    """Defers a reducer's end-of-backward callback from a nested backward pass to the one enclosing it: one reduction per
    backward, at the end of the outermost pass. ``queue_end`` queues that callback on the graph task running now (the
    reducer's, called through a weak reference).

    See "Activation checkpointing" in ``docs/design.md``. A reentrant checkpoint's nested backward is a graph task of its own,
    run inside a node of the enclosing task (``torch._C._current_autograd_node()``; ``None`` at the end of the outermost),
    and the end-of-backward callback runs at the end of the task it was queued on. :meth:`defer` hands the end over to the
    enclosing task: a pre-hook on the node's next functions (one of which runs, as the node needs a gradient for one of its
    inputs) queues the callback again. A param's extra gradients from several segments: ``ShardGrads`` (``expected``) and
    ``GradReducer._take_grad``.
    """

    def __init__(self, queue_end: Callable[[], None]) -> None:
        self._queue_end = queue_end
        self._handles: list[RemovableHandle] = []  # pre-hooks on the enclosing task's nodes, until the pass ends
        self._armed = False  # a pre-hook is yet to queue the callback

    def defer(self) -> bool:
        """Called at the end of a backward pass: whether it was a nested one, whose end is handed to the enclosing pass."""
        node = current_autograd_node()
        if node is None:
            return False
        nodes = [fn for fn, _ in node.next_functions if fn is not None]
        self._handles += [fn.register_prehook(self._on_enclosing) for fn in nodes]
        self._armed = self._armed or bool(nodes)
        return bool(nodes)  # none (not expected): end the pass here

    def _on_enclosing(self, grad_outputs: tuple[torch.Tensor, ...]) -> None:
        """A node of the enclosing task runs: queue the end-of-backward callback on that task (once)."""
        if self._armed:
            self._armed = False
            self._queue_end()

    def clear(self) -> None:
        """At the end of the pass (or after one that raised): remove the pre-hooks (not from inside one: the engine is iterating them)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._armed = False
