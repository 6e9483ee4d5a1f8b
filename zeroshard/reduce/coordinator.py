"""One coordinator per process group: the order of its reducers' gradient collectives, which reducer owns each param, one overflow decision.

See "Collective order" in ``docs/design.md`` and "Limits" in ``docs/shape_aware.md`` (why two optimizers on one process
group take turns, what that costs, their one overflow decision). Reducers take turns in the order they were built (the
same on every rank): a reducer launches nothing until every earlier one has launched all its buckets, and completes theirs
before its first launch (one order for hybrid sharding's all-reduces too).

A param carries the hooks of one reducer at most (two would both take its gradient): a newer one takes them over
(:func:`take_over`), and the older one raises if stepped again. The param gather's guard (``gather/param_gather.py``) and
the watch for new DDP wrappers (``ddp.py``) stay process-wide, as torch keeps what they mirror. A coordinator holds its
reducers weakly, through :class:`Reducer`, so a dropped optimizer is freed at once.
"""

from __future__ import annotations

import enum
import gc
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from zeroshard.reduce.ddp import DDPWrappers


class EndOfBackward(enum.Enum):
    """Where a reducer stands with its end-of-backward callback (autograd's ``queue_callback``) in the running backward pass."""

    NONE = "none"  # none queued: it got no gradient in this pass (or accumulates alone)
    QUEUED = "queued"  # queued: when it runs, the reducer reduces this pass, every reducer of the group's (flush)
    DONE = "done"  # queued, with nothing left to do: another reducer's flush reduced this pass, or found it accumulating


class Reducer(Protocol):
    """What a :class:`ReduceCoordinator` reads and calls of a ``GradReducer``."""

    end_of_backward: EndOfBackward  # its end-of-backward callback in the running pass
    grow: Callable[[], object] | None  # its optimizer's: shard the params unfrozen since (collectives); whether there were some
    ddp_wrappers: DDPWrappers  # the DistributedDataParallel wrappers around its params

    @property
    def closed(self) -> bool: ...  # taken over or closed: its hooks do nothing
    @property
    def accumulating(self) -> bool: ...  # under no_sync (its own, or DDP's): this backward reduces nothing
    @property
    def launched_all(self) -> bool: ...  # it launches nothing more in this backward pass

    def close(self, reason: str) -> None: ...
    def drain(self) -> None: ...  # complete its reductions in flight
    def take_deferred(self) -> None: ...  # take the gradient it deferred (GradReducer._deferred)
    def launch_complete_buckets(self) -> None: ...
    def local_used(self) -> list[list[bool]]: ...  # per shard, per param: got a gradient on this rank since the last reset
    def end_pass(self) -> None: ...  # forget the pass (under no_sync: at its end)
    def settle_all(self) -> None: ...  # follow what user code did to its params' .grad
    def reduce_everything(self) -> None: ...  # reduce every bucket of this pass (zeros where no gradient came)
    def rebuild_order(self) -> None: ...  # adopt the first reduced backward's launch order (a collective, once)
    def reduce_late(self) -> None: ...  # a param got more gradients than ever (reentrant checkpoints): every bucket again


class ReduceCoordinator:
    """The reducers of one process group, in the order they were built (:meth:`register`), and the params they own (:func:`coordinator_of`)."""

    def __init__(self) -> None:
        self._reducers: list[weakref.ref] = []  # in the order they were built
        # A single reducer is live and open (recount): then it is the caller. The common case, one optimizer per process group
        # (also after an earlier one was closed or dropped), reads this attribute per gradient, not a pass over weak references.
        self.alone = False
        self._owned: dict[int, tuple[weakref.ref, weakref.ref]] = {}  # id(param) -> (param, reducer), both weak
        self._scaled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer with a dynamic loss scale -> (scaler, reducer)
        self._joint: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> ids of the optimizers of its last joint clip

    def register(self, reducer: Reducer) -> None:
        """Add ``reducer`` after those built before (construction runs at the same point on every rank: the same reducers everywhere).

        Garbage is collected first if another open reducer is registered: one dropped in a reference cycle (an optimizer kept
        by an exception's traceback) would hold the later ones back until the collector runs, at different times per rank.
        """
        if any((r := ref()) is not None and not r.closed for ref in self._reducers):
            gc.collect()  # only when another open reducer is registered: a full collection takes 50-150 ms
        self._reducers[:] = [ref for ref in self._reducers if ref() is not None]
        self._reducers.append(weakref.ref(reducer, self.recount))
        self.recount()

    def recount(self, _: object = None) -> None:
        """Whether one reducer is left (:attr:`alone`), after one registered, closed (``GradReducer.close``) or was dropped."""
        self.alone = len(self._live()) == 1

    def own(self, param: nn.Parameter, reducer: Reducer) -> None:
        """Record that ``reducer``'s hooks are on ``param`` (both held weakly)."""
        self._owned[id(param)] = (weakref.ref(param), weakref.ref(reducer))

    def owner_of(self, param: nn.Parameter) -> Reducer | None:
        """The live, open reducer of this group whose hooks are on ``param``, or ``None``."""
        entry = self._owned.get(id(param))
        if entry is None:
            return None
        held, reducer = entry[0](), entry[1]()
        if held is not param or reducer is None or reducer.closed:
            del self._owned[id(param)]
            return None
        return reducer

    def _live(self) -> list[Reducer]:
        return [r for ref in self._reducers if (r := ref()) is not None and not r.closed]

    def _others(self, reducer: Reducer, later: bool = False) -> list[Reducer]:
        """The live reducers built before ``reducer`` (``later``: after it); none if it is not live."""
        live = self._live()
        if reducer not in live:
            return []
        return live[live.index(reducer) + 1 :] if later else live[: live.index(reducer)]

    def turn_has_come(self, reducer: Reducer) -> bool:
        """Whether every earlier reducer has launched all it launches in this backward pass."""
        return self.alone or all(r.launched_all for r in self._others(reducer))

    def drain_earlier(self, reducer: Reducer) -> None:
        """Complete the earlier reducers' reductions in flight, before ``reducer`` launches (one order across replicas too)."""
        if not self.alone:
            for r in self._others(reducer):
                r.drain()

    def take_deferred(self, reducer: Reducer) -> None:
        """A gradient is about to be accumulated into a param of ``reducer``: every reducer takes the one it deferred (``GradReducer._deferred``)."""
        for r in [reducer] if self.alone else self._live():
            r.take_deferred()

    def let_later_launch(self, reducer: Reducer) -> None:
        """``reducer`` launched everything: the later reducers taking part in this pass launch their complete buckets."""
        if not self.alone:
            for r in self._others(reducer, later=True):
                if r.end_of_backward is EndOfBackward.QUEUED:
                    r.launch_complete_buckets()

    def flush(self, reducer: Reducer) -> None:
        """At ``reducer``'s end of backward, the first of the pass: every reducer reduces, in the order they were built.

        Those that took part reduce what they got (their own callbacks, still queued, then return at once); those that
        got no gradient on this rank reduce zeros, as the backward may reach other optimizers on other ranks and every
        rank must issue every collective in one order; those under ``no_sync`` reduce nothing.

        The launch orders are agreed on (a broadcast each) only after every reducer's reductions: a later reducer may
        launch buckets during the pass on one rank and only here on another, so a broadcast between would meet a
        reduce-scatter. If a reduction raises, autograd drops the callbacks queued after this one: none is left queued.
        """
        try:
            reduced = []
            for r in self._live():
                queued = r is not reducer and r.end_of_backward is EndOfBackward.QUEUED  # its callback, still to run, returns at once (DONE)
                if r.accumulating:  # accumulates locally: its callback has nothing to do
                    r.end_pass()
                elif r is reducer or queued or r.end_of_backward is EndOfBackward.NONE:
                    if r is not reducer and not queued:  # got no gradient here: reduce zeros, after following what was done to its gradients
                        r.settle_all()
                    r.reduce_everything()
                    reduced.append(r)
                if queued:
                    r.end_of_backward = EndOfBackward.DONE
            for r in reduced:
                r.rebuild_order()
            with torch.no_grad():  # a backward(create_graph=True) ends with grad mode on
                for r in reduced:  # a gradient after its bucket's reduction (reentrant checkpoints; the ranks agree): every bucket again
                    r.reduce_late()
                # Params unfrozen since: sharded, then every bucket reduced again with them. Only now, after the pass's last collective
                # on every rank: ranks launch a pass's buckets at different times, and a sharding before would meet a reduce-scatter.
                for r in reduced:
                    if r.grow is not None and r.grow():
                        r.reduce_everything()
            for r in reduced:  # every optimizer has sharded its unfrozen params
                r.ddp_wrappers.check_covered(held)
        except BaseException:
            for r in self._live():
                r.end_of_backward = EndOfBackward.NONE
            raise

    def note_dynamic_scale(self, opt: object, scaler: object, reducer: Reducer) -> None:
        """Record that optimizer ``opt`` updates the dynamic loss scale ``scaler`` from the gradients of ``reducer`` (:meth:`check_one_overflow_decision`)."""
        self._scaled[opt] = (scaler, reducer)

    def note_joint(self, opt: object, optimizers: Iterable[object]) -> None:
        """``zeroshard.clip_grad_norm_`` checked the gradients of ``opt`` together with those of ``optimizers`` for their coming steps."""
        self._joint[opt] = frozenset(id(o) for o in optimizers)

    def check_one_overflow_decision(self, opt: object) -> None:
        """At the start of ``opt.step()``: raise ``RuntimeError``, naming the way out, if another open ``ShardedOptimizer``
        with a dynamic loss scale shares this process group, has gradients of this step waiting for its own ``step()``,
        and was not checked together with it (:func:`zeroshard.clip_grad_norm_`).

        Each wrapper's scaler decides alone whether its gradients overflowed: two wrappers over one loss that decide
        differently would drift apart in scale, silently wrong. Raised on every rank alike, before any collective.
        """
        joint = self._joint.pop(opt, frozenset())
        if opt not in self._scaled:
            return
        # Others whose gradients wait for their own step now: not one dropped and not yet collected
        # (no collection here: a finalizer may run collectives, at different times on different ranks).
        others = [o for o, (_, reducer) in list(self._scaled.items())
                  if o is not opt and not reducer.closed and id(o) not in joint and any(any(flags) for flags in reducer.local_used())]
        if others:
            raise RuntimeError(
                f"{len(others) + 1} open ShardedOptimizers with a dynamic loss scale share one process group (one model, two optimizers?): "
                "each would decide alone whether the gradients overflowed, and their loss scales would drift apart. Before their "
                "step()s, call zeroshard.clip_grad_norm_(optimizers, max_norm) over all of them every step (max_norm=math.inf to "
                "check for overflow without clipping)"
            )

    def scales(self, scaler: object) -> bool:
        """Whether an open optimizer of this group updates ``scaler`` at its steps."""
        return any(s is scaler and not reducer.closed for s, reducer in list(self._scaled.values()))

    def shared(self) -> bool:
        """Whether the group has more than one open reducer (a reducer under ``no_sync`` then still ends each backward: :meth:`flush`)."""
        return len(self._live()) > 1


_COORDINATORS: dict[int, ReduceCoordinator] = {}  # id of a process group -> its coordinator


def coordinator_of(group: Any) -> ReduceCoordinator:
    """The coordinator of process group ``group`` (made on first use)."""
    found = _COORDINATORS.get(id(group))
    if found is None:
        found = _COORDINATORS[id(group)] = ReduceCoordinator()
    return found


def owners_of(params: Iterable[nn.Parameter]) -> list[Reducer]:
    """The live reducers, on any process group, that own one of ``params`` (each once)."""
    found = {id(owner): owner for p in params for c in list(_COORDINATORS.values()) if (owner := c.owner_of(p)) is not None}
    return list(found.values())


def held(param: nn.Parameter) -> bool:
    """Whether a live reducer, on any process group, has its hooks on ``param`` (``DDPWrappers.check_covered``)."""
    return bool(owners_of([param]))


def take_over(params: Sequence[nn.Parameter], names: Sequence[str]) -> None:
    """Close every live reducer that hooks one of ``params`` (named ``names``): a new optimizer takes them over."""
    for param, name in zip(params, names):
        for owner in owners_of([param]):
            owner.close(f"{name} (shape {tuple(param.shape)}) was taken over by a ShardedOptimizer built later on the same params: "
                        "step that one (two optimizers cannot both reduce one param's gradients)")


def ddp_wrappers_of_owners(params: Iterable[nn.Parameter]) -> list[DDPWrappers]:
    """The :class:`DDPWrappers` of every live reducer that owns one of ``params``."""
    return [owner.ddp_wrappers for owner in owners_of(params)]


def scaler_in_use(scaler: object) -> bool:
    """Whether an open ``ShardedOptimizer`` on any process group already updates ``scaler`` (a ``DynamicLossScaler``) at its steps."""
    return any(c.scales(scaler) for c in list(_COORDINATORS.values()))
