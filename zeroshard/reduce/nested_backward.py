"""Reentrant activation checkpointing: one reduction per backward, at the end of the outermost pass.

See "Activation checkpointing" in ``docs/design.md``. A reentrant checkpoint's nested backward is a graph task of its own,
run inside a node of the enclosing task (``torch._C._current_autograd_node()``; ``None`` at the end of the outermost),
and the end-of-backward callback runs at the end of the task it was queued on. :meth:`OutermostBackward.defer` hands the
end over to the enclosing task: a pre-hook on the node's next functions (one of which runs, as the node needs a gradient
for one of its inputs) queues the callback again. A param's extra gradients from several segments: ``ShardGrads``
(``expected``) and ``GradReducer._take_grad``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.hooks import RemovableHandle

from zeroshard.compat import current_autograd_node


class OutermostBackward:
    """Defers a reducer's end-of-backward callback from a nested backward pass to the one enclosing it; ``queue_end`` queues
    that callback on the graph task running now (the reducer's, called through a weak reference)."""

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
