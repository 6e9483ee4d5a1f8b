"""Thin typed wrappers over the ``torch.distributed`` collectives zeroshard uses. On gloo (CPU tensors) the bucket
reduce-scatter and all-gather run as point-to-point sends and receives instead (:class:`PointToPointWork`; why: docs/design.md,
"Collectives on gloo")."""

from __future__ import annotations

import datetime
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

# Point-to-point message tags of the two bucket collectives (gloo matches a pair's messages of one
# tag first in, first out; every rank posts its buckets in the same order).
_REDUCE_SCATTER_TAG = 0x2A01
_ALL_GATHER_TAG = 0x2A02
# Set to False to run gloo's own reduce_scatter_tensor / all_gather_into_tensor (for comparison).
POINT_TO_POINT_ON_GLOO = True
_SAME_BUILD = "every rank must build the optimizer on the same params in the same order, with the same options"


class PointToPointWork:
    """The handle of a reduce-scatter or all-gather run as point-to-point sends and receives: answers ``wait(timeout=None)``
    and ``is_completed()`` as a ``dist.Work`` does; ``finish`` (the reduce-scatter's sum of the received pieces) runs once."""

    def __init__(self, works: list[dist.Work], finish: Callable[[], None] | None = None) -> None:
        self._works = works
        self._finish = finish

    def is_completed(self) -> bool:
        """Whether every send and receive has completed (the sum, if any, runs in :meth:`wait`). gloo's point-to-point works
        answer ``False`` until they are waited for, so in practice this turns ``True`` only after :meth:`wait`."""
        return all(work.is_completed() for work in self._works)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Wait for every send and receive (each within ``timeout``), then finish; ``True`` as ``dist.Work.wait``.

        Raises:
            RuntimeError: a send or receive did not complete within ``timeout`` (gloo's error).
        """
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout)
        self._works = []
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True


# The handle of an async bucket collective: torch's, or point to point (both answer wait / is_completed).
AsyncWork = dist.Work | PointToPointWork


def point_to_point(tensor: Tensor, group: ProcessGroup) -> bool:
    """Whether :func:`reduce_scatter` and :func:`all_gather` of ``tensor`` on ``group`` run point to point (CPU tensors on gloo)."""
    return POINT_TO_POINT_ON_GLOO and tensor.device.type == "cpu" and dist.get_backend(group) == "gloo"


def _exchange(sends: dict[int, Tensor], receives: dict[int, Tensor], group: ProcessGroup, tag: int) -> list[dist.Work]:
    """Post a send of ``sends[q]`` to and a receive into ``receives[q]`` from each group rank ``q``."""
    posted = [(dist.isend(sends[q], dst=dist.get_global_rank(group, q), group=group, tag=tag),
               dist.irecv(receives[q], src=dist.get_global_rank(group, q), group=group, tag=tag)) for q in sends]
    return [work for pair in posted for work in pair if work is not None]


def reduce_scatter(output: Tensor, input: Tensor, group: ProcessGroup, *, input_frozen: bool = False) -> AsyncWork:
    """Start a sum reduce-scatter: rank r receives the sum over ranks of ``input[r*n:(r+1)*n]``.

    Mirrors ``torch.distributed.reduce_scatter_tensor`` (``op=SUM``). On gloo each rank sends every other rank its piece and
    adds what it receives to its own, in group rank order (at 2 ranks the same bits as gloo's own sum: one addition,
    commutative); ``N - 1`` pieces of ``n`` elements are held for the receives until ``wait()``. Its own piece is copied into
    ``output`` at once, unless ``input_frozen``: then the first sum reads it at ``wait()`` and writes ``output`` (one pass fewer).

    Args:
        output: 1-D, ``n`` elements, same dtype and device as ``input``; written when the work completes.
        input: 1-D, ``n * group.size()`` elements; not written.
        group: the sharding process group.
        input_frozen: the caller writes ``input`` only after ``wait()`` (a staging bucket, a copy).

    Returns:
        The async work handle; call ``wait()`` before reading ``output`` or writing ``input``.
    """
    if not point_to_point(input, group):
        return dist.reduce_scatter_single(output, input, group=group, async_op=True)
    me, n = dist.get_rank(group), output.numel()
    pieces = list(input.view(-1, n).unbind())
    others = [q for q in range(len(pieces)) if q != me]
    received = {q: torch.empty_like(output) for q in others}
    works = _exchange({q: pieces[q] for q in others}, received, group, _REDUCE_SCATTER_TAG)
    frozen = input_frozen and bool(others)  # a group of one: nothing to sum, the own piece is the result
    if not frozen:
        output.copy_(pieces[me])  # read now: the input may change before wait() (the sends read theirs while in flight)

    def finish() -> None:
        if frozen:
            torch.add(pieces[me], received[others[0]], out=output)
        for q in others[1:] if frozen else others:
            output.add_(received[q])

    return PointToPointWork(works, finish)


def all_gather(output: Tensor, input: Tensor, group: ProcessGroup) -> AsyncWork:
    """Start an all-gather: ``output[r*n:(r+1)*n]`` receives rank r's ``input``.

    Mirrors ``torch.distributed.all_gather_into_tensor``; on gloo, each rank sends its slot to every other rank and receives
    theirs. ``input`` may be this rank's own slot of ``output`` (an in-place gather: how updated slices return to the flat buffer).

    Args:
        output: 1-D, ``n * group.size()`` elements.
        input: 1-D, ``n`` elements, same dtype and device as ``output``.
        group: the sharding process group.

    Returns:
        The async work handle; call ``wait()`` before reading ``output``.
    """
    if not point_to_point(input, group):
        return dist.all_gather_single(output, input, group=group, async_op=True)
    world, me = dist.get_world_size(group), dist.get_rank(group)
    slots = output.view(world, -1).unbind()
    if slots[me].data_ptr() != input.data_ptr():
        slots[me].copy_(input)
    others = [q for q in range(world) if q != me]
    return PointToPointWork(_exchange({q: slots[me] for q in others}, {q: slots[q] for q in others}, group, _ALL_GATHER_TAG))


def all_reduce(tensor: Tensor, group: ProcessGroup, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> dist.Work:
    """Start an in-place all-reduce of ``tensor`` over ``group``; call :func:`wait` on the handle before reading ``tensor``."""
    return dist.all_reduce(tensor, op=op, group=group, async_op=True)


def wait(work: AsyncWork, timeout: datetime.timedelta | None, what: str, hint: str) -> None:
    """Wait for ``work``; with a ``timeout``, raise a ``RuntimeError`` naming the collective after it.

    Without a timeout this is ``work.wait()``: the process group's own timeout applies (30 minutes by default). With one,
    ``work.wait(timeout=...)`` returns or raises within it (gloo raises "Operation timed out!"; NCCL blocks the host until the
    collective completes or times out). Afterwards the process group is unusable: the collective may still be pending elsewhere.

    Args:
        work: the handle of an async collective.
        timeout: the bound, or ``None``.
        what: the collective, for the message (e.g. ``"step(): the all-gather of updated params"``).
        hint: what every rank must do alike, for the message (e.g. ``"call step()"``).

    Raises:
        RuntimeError: ``work`` did not complete within ``timeout`` (or failed while waiting).
    """
    if timeout is None:
        work.wait()
        return
    started = time.monotonic()
    try:
        work.wait(timeout=timeout)
    except RuntimeError as error:
        waited = time.monotonic() - started
        # A peer that aborted (gloo ends a process whose collective sizes differ) fails the wait early: say so, not a timeout.
        outcome = f"did not complete within {timeout.total_seconds():g} s" if waited >= 0.9 * timeout.total_seconds() else \
            f"failed after {waited:.1f} s (a peer closed the connection: it ended, or aborted on a collective of another size)"
        raise RuntimeError(
            f"{what} {outcome} on rank {dist.get_rank()} ({error}): every rank must {hint}. "
            "Some rank did not take part (it skipped the call, raised, or is still in an earlier one). The process group cannot be "
            "used after this error: end the run on every rank"
        ) from error


# What a rank that misses consolidate_state_dict() makes the others wait in, and what they must all do.
CONSOLIDATION = "consolidate_state_dict(): the gather of the optimizer state onto one rank"
_CONSOLIDATE = "call consolidate_state_dict() with the same to="


def gather(tensor: Tensor, outputs: list[Tensor] | None, dst: int, group: ProcessGroup, timeout: datetime.timedelta | None = None) -> None:
    """Gather every rank's ``tensor`` (the same shape, dtype and device on every rank) into ``outputs`` on global rank ``dst``
    (blocking; ``torch.distributed.gather``): on ``dst``, ``group.size()`` tensors like it (``outputs[r]`` gets group rank r's),
    ``None`` on the other ranks. Raises ``RuntimeError`` past ``timeout`` (:func:`wait`; a consolidation's)."""
    wait(cast(dist.Work, dist.gather(tensor, outputs, dst=dst, group=group, async_op=True)), timeout, CONSOLIDATION, _CONSOLIDATE)


def send(tensor: Tensor, dst: int, group: ProcessGroup, timeout: datetime.timedelta | None = None) -> None:
    """Send ``tensor`` (contiguous) to group rank ``dst`` (blocking; ``torch.distributed.isend``), which calls :func:`recv`.
    Raises ``RuntimeError`` past ``timeout`` (:func:`wait`; a consolidation's)."""
    wait(cast(dist.Work, dist.isend(tensor, dst=dist.get_global_rank(group, dst), group=group)), timeout, CONSOLIDATION, _CONSOLIDATE)


def recv(tensor: Tensor, src: int, group: ProcessGroup, timeout: datetime.timedelta | None = None) -> None:
    """Receive into ``tensor`` (contiguous; the shape and dtype sent) from group rank ``src`` (blocking; ``torch.distributed.irecv``).
    Raises ``RuntimeError`` past ``timeout`` (:func:`wait`; a consolidation's)."""
    wait(cast(dist.Work, dist.irecv(tensor, src=dist.get_global_rank(group, src), group=group)), timeout, CONSOLIDATION, _CONSOLIDATE)


def broadcast_from_first_(tensors: Sequence[Tensor], group: ProcessGroup, timeout: datetime.timedelta | None = None,
                          caller: str = "the ShardedOptimizer constructor") -> None:
    """Overwrite ``tensors`` on every rank with those of the group's rank 0 (blocking; each within ``timeout``: :func:`wait`)."""
    src = dist.get_global_rank(group, 0)
    works = [dist.broadcast(t, src=src, group=group, async_op=True) for t in tensors]
    for work in works:
        wait(work, timeout, f"{caller}: the broadcast of rank {src}'s param values", f"call {caller}")


def check_same_on_all_ranks(what: str, fingerprint: Sequence[tuple[Any, ...]], group: ProcessGroup, remedy: str = _SAME_BUILD,
                            timeout: datetime.timedelta | None = None, caller: str = "the ShardedOptimizer constructor") -> None:
    """Raise on every rank if any rank's ``fingerprint`` differs from that of the group's rank 0.

    Each entry is hashed (64-bit BLAKE2b of its ``repr``) and the hashes are all-gathered as one int64 tensor: no pickled
    object collective, which torch >= 2.13 runs through NumPy. Only on a mismatch are the two differing entries broadcast, as
    UTF-8 bytes, to name them. Run it before the first collective whose tensor sizes depend on the fingerprint: gloo aborts
    the process (not an exception) when ranks pass tensors of different sizes.

    Args:
        what: a name for the entries, used in the error (e.g. ``"param"``).
        fingerprint: one tuple per entry; its first element names the entry in errors.
        group: the process group to compare over.
        remedy: what the error tells the user to do.
        timeout: the bound on its first collectives (:func:`wait`), or ``None``: the process group's.
        caller: the call every rank must make, for the timeout's message.

    Raises:
        ValueError: on every rank of ``group``, naming the first differing (global) rank, the entry and both values.
        RuntimeError: past ``timeout``, some rank did not join (it skipped ``caller``).
    """
    world = dist.get_world_size(group)
    if world == 1:
        return
    device = collective_device(group)
    bound = (timeout, f"{caller}: the check that every rank has the same {what}s", f"call {caller}")
    counts = all_gather_int64(torch.tensor([len(fingerprint)], device=device), group, *bound)
    longest = max(int(c) for c in counts)
    hashes = torch.tensor([_digest(entry) for entry in fingerprint] + [0] * (longest - len(fingerprint)), dtype=torch.int64)
    gathered = all_gather_int64(hashes.to(device), group, *bound)
    reference, n_reference = gathered[0].cpu(), int(counts[0])
    first = dist.get_global_rank(group, 0)
    for rank in range(1, world):
        theirs, n_theirs, their_rank = gathered[rank].cpu(), int(counts[rank]), dist.get_global_rank(group, rank)
        common = min(n_reference, n_theirs)
        differs = (theirs[:common] != reference[:common]).nonzero()
        if len(differs):
            index = int(differs[0])
            label, values = (str(fingerprint[index][0]), repr(fingerprint[index][1:])) if index < len(fingerprint) else (None, None)
            name, first_name, other, first_value = (_broadcast_text(text, src, group, device) for text in (label, values) for src in (rank, 0))
            if name != first_name:  # entries out of step (a param in another group, a group more or less): name both
                raise ValueError(f"{what} {index} differs: rank {their_rank} has {name} {other} there, rank {first} {first_name} {first_value}; {remedy}")
            raise ValueError(f"{what} {name} on rank {their_rank} is {other}, on rank {first} {first_value}; {remedy}")
        if n_theirs != n_reference:  # name the first entry the longer fingerprint has past the other's end
            longer, index = (rank, n_reference) if n_theirs > n_reference else (0, n_theirs)
            extra = _broadcast_text(f"{fingerprint[index][0]} {fingerprint[index][1:]!r}" if index < len(fingerprint) else None,
                                    longer, group, device)
            raise ValueError(f"rank {their_rank} has {n_theirs} {what}s, rank {first} has {n_reference} (the first one more, on rank "
                             f"{dist.get_global_rank(group, longer)}: {extra}); {remedy}")


def _digest(entry: tuple[Any, ...]) -> int:
    """A signed 64-bit hash of ``repr(entry)``, the same in every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(repr(entry).encode(), digest_size=8).digest(), "little", signed=True)


def collective_device(group: ProcessGroup | None) -> torch.device:
    """Where small tensors for collectives on ``group`` (``None``: the default group) must live: for NCCL the device the group
    is bound to (``init_process_group(device_id=...)``), else the current CUDA device, as torch's object collectives choose it;
    other backends: the CPU."""
    if dist.get_backend(group) == "nccl":
        bound = getattr(group, "bound_device_id", None)  # None: the default group
        return bound if bound is not None else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_int64(tensor: Tensor, group: ProcessGroup, timeout: datetime.timedelta | None, what: str, hint: str) -> list[Tensor]:
    """Every rank's ``tensor`` (1-D int64, the same length on every rank), in group rank order (blocking; :func:`wait`)."""
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    wait(dist.all_gather(gathered, tensor, group=group, async_op=True), timeout, what, hint)
    return gathered


def _broadcast_text(text: str | None, src: int, group: ProcessGroup, device: torch.device) -> str:
    """``text`` from group rank ``src`` on every rank, sent as UTF-8 bytes (blocking; ``None`` sends "")."""
    source = dist.get_global_rank(group, src)
    payload = torch.tensor(list((text or "").encode()), dtype=torch.uint8, device=device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=source, group=group)
    if dist.get_rank(group) != src:
        payload = torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=source, group=group)
    return bytes(payload.cpu().tolist()).decode()
