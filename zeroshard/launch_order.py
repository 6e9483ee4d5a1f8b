"""One order for the gradient collectives of every ``GradReducer`` on a process group.

A ``GradReducer`` launches its buckets in a fixed order, the same on every rank, each as soon as
its gradients are ready (``overlap_comm``) or at the end of backward. Two reducers on one process
group (two ``ShardedOptimizer`` s over one model: Muon on the matrices and AdamW on the rest)
would interleave their launches by when gradients become ready, and that differs between ranks
when a param is unused on some ranks only: ranks would issue different collectives, and gloo
aborts on a size mismatch (equal sizes would mix gradients in silence).

So reducers on one process group take turns, in the order they were built (the same on every
rank, construction being a collective): in a backward pass a reducer launches nothing until every
earlier one has launched all its buckets, and before its first launch it completes theirs (so the
all-reduces across replicas of hybrid sharding keep one order too). A reducer that has launched
everything lets the later ones launch what is ready. At the end of backward, the first reducer
whose callback runs reduces every reducer of the group, in order (``flush``), those that got no
gradient on this rank too; their own callbacks then have nothing left to do. A reducer under
``no_sync`` launches nothing and holds no one back. The one place this costs: optimizers of two
models trained in turn (a GAN's) on one process group reduce zeros for the model a backward did
not reach. The one order costs overlap: a later reducer's buckets wait for the earlier reducers'
last bucket. Give a wrapper a process group of its own (``dist.new_group``) to overlap both.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

_REDUCERS: dict[int, list[weakref.ref]] = {}  # id of a process group -> its reducers, in the order they were built


def register(reducer: Any, group: Any) -> None:
    """Add ``reducer`` (a ``GradReducer``) to the reducers of process group ``group``, after those built before.

    Garbage is collected first, if another open reducer is registered: a reducer dropped in a
    reference cycle (an optimizer kept by an exception's traceback) would otherwise hold the later
    ones back until the collector runs, which happens at different times on different ranks. Construction runs at the same point of the
    program on every rank, so every rank sees the same reducers from then on (an optimizer dropped
    without a cycle is freed at once, by reference counting).
    """
    reducers = _REDUCERS.setdefault(id(group), [])
    if any((r := ref()) is not None and not r.closed for ref in reducers):
        gc.collect()  # only when another open reducer is registered: a full collection takes 50-150 ms
    reducers[:] = [ref for ref in reducers if ref() is not None]
    reducers.append(weakref.ref(reducer))


def _alone(group: Any) -> bool:
    """Whether ``group`` has a single reducer registered: then it is the caller (open, or its hooks would not have run).

    The common case, one optimizer per process group, takes this one length check per gradient
    instead of a pass over weak references.
    """
    return len(_REDUCERS.get(id(group), ())) == 1


def _live(group: Any) -> list[Any]:
    found = [ref() for ref in _REDUCERS.get(id(group), [])]
    return [r for r in found if r is not None and not r.closed]


def earlier(reducer: Any, group: Any) -> list[Any]:
    """The open reducers of ``group`` built before ``reducer``, in order."""
    live = _live(group)
    return live[: live.index(reducer)] if reducer in live else []


def later(reducer: Any, group: Any) -> list[Any]:
    """The open reducers of ``group`` built after ``reducer``, in order."""
    live = _live(group)
    return live[live.index(reducer) + 1 :] if reducer in live else []


def _launched_all(r: Any) -> bool:
    """Whether reducer ``r`` launches nothing more in the current backward pass."""
    return r._next_launch == len(r._order) or r._no_sync or r._ddp_no_sync or r._flushed


def turn_has_come(reducer: Any, group: Any) -> bool:
    """Whether every earlier reducer of ``group`` has launched all it launches in this backward pass."""
    return _alone(group) or all(_launched_all(r) for r in earlier(reducer, group))


def drain_earlier(reducer: Any, group: Any) -> None:
    """Complete the earlier reducers' reductions in flight, before ``reducer`` launches (one order across replicas too)."""
    if _alone(group):
        return
    for r in earlier(reducer, group):
        r._drain()


def take_deferred(reducer: Any, group: Any) -> None:
    """A gradient is about to be accumulated into a param of ``reducer``: every reducer of ``group`` takes the one it deferred (see ``ArrivedGrad``)."""
    if _alone(group):
        reducer._take_deferred()
        return
    for r in _live(group):
        r._take_deferred()


def let_later_launch(reducer: Any, group: Any) -> None:
    """``reducer`` launched everything: the later reducers taking part in this pass launch their complete buckets."""
    if _alone(group):
        return
    for r in later(reducer, group):
        if r._callback_queued:
            r._launch_complete_buckets()


def flush(reducer: Any, group: Any) -> None:
    """At ``reducer``'s end of backward, the first of the pass: every reducer of ``group`` reduces, in the order they were built.

    Those that took part in the pass reduce what they got; their own end-of-backward callbacks,
    still queued, then return at once. Those that got no gradient on this rank reduce zeros for
    all their params, as they do on a rank where they took part: which optimizers a backward
    reaches may differ between ranks (an optimizer's params used on some ranks only), and every
    rank must still issue every collective in one order (otherwise equal-sized buckets of two
    optimizers would be summed together, in silence). Reducers under ``no_sync`` reduce nothing,
    and queue this callback all the same when the group has others, for the others' sake.
    """
    for r in _live(group):
        if r._no_sync or r._ddp_no_sync:  # accumulates locally (its callback, if queued, has nothing to do)
            if r is reducer:
                r._callback_queued = False
            elif r._callback_queued:
                r._flushed = True
        elif r is reducer:
            r._reduce_everything()
        elif r._callback_queued:
            if not r._flushed:
                r._reduce_everything()
                r._flushed = True
        else:  # got no gradient here: reduce zeros, after following what was done to its gradients
            r._settle_all()
            r._reduce_everything()


def shared(group: Any) -> bool:
    """Whether ``group`` has more than one open reducer (a reducer under ``no_sync`` then still ends each backward: ``flush``)."""
    return len(_live(group)) > 1
