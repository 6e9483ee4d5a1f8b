"""Reentrant activation checkpointing: one reduction per backward, at the end of the outermost pass.

A ``GradReducer`` reduces what is left of a backward pass in an autograd engine callback, queued
by the first gradient hook of the pass (``Variable._execution_engine.queue_callback``). The engine
queues a callback on the graph task running now and runs it when that task ends. A reentrant
checkpoint (``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``, the default of
transformers 4.x's ``gradient_checkpointing_enable()``) recomputes its segment in its backward node
and runs a *nested* backward over it: a graph task of its own, on the same thread, inside the
enclosing task's node. Had the first gradient of a pass arrived in a nested backward (every param
behind the loss inside checkpointed segments, a head tied to an embedding), the callback would
run when that nested backward ends: every checkpointed segment would reduce every bucket again,
and ranks that checkpointed different numbers of segments would issue different numbers of
collectives and hang.

So the callback first asks whether it ends a nested backward: then the engine is still inside the
enclosing task's node (``torch._C._current_autograd_node()`` is that node; ``None`` at the end of
the outermost). :meth:`OutermostBackward.defer` hands the end over to the enclosing task: a pre-hook
on the node's next functions, which run in that task after the node, queues the callback again
there (gradient hooks in the enclosing task, or in a later nested backward, queue it as usual).
A node that runs a backward needs a gradient for one of its inputs, so one of them runs.

A param used in several checkpointed segments (or in and out of one) gets one gradient per
nested backward, where autograd otherwise sums its uses into one. ``ShardGrads`` counts them:
a bucket is complete once each param got as many as it ever got in one pass (``expected``). The
first pass with more (the first step) finds the bucket already reduced: the gradient stays local
and ``step()`` reduces every bucket once more (``GradReducer._take_grad``), as it does after
``no_sync``. Ranks running the same model code agree on this; a shared param used in more
reentrant segments on some ranks than on others, for the first time, would not.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.hooks import RemovableHandle

from zeroshard.compat import current_autograd_node


class OutermostBackward:
    """Defers a reducer's end-of-backward callback from a nested backward pass to the one enclosing it.

    Args:
        queue_end: queues the end-of-backward callback on the graph task running now (the
            reducer's, called through a weak reference).
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
