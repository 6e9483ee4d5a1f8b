"""A chunk: this rank's slice of one bucket, the unit that owns and moves optimizer state ([Note: zeroshard buffers] in
``zeroshard/layout/flat_buffer.py``). It only views the flat param buffer and the grad shard; all it owns lives in one place,
the params' device or host memory (``offload="cpu"``), and moves as a whole (:meth:`Chunk.move_to_device`).

Pinning rules. Page-locked memory is scarce, so only what crosses PCIe every step is pinned, and only when the params are
on CUDA (a CPU-only run has nothing to copy to or from):

* the host copy of a chunk's gradient (:meth:`Chunk.host_grad_buffer`): the destination of the device → host copy;
* the source of the copy back: the host master itself for fp32/fp64 params (allocated in ``Chunk.__init__``), or, for
  16-bit params, a staging buffer in the param dtype that receives the cast of the updated master (:meth:`Chunk.host_param_buffer`);
* never the moments, which do not leave the host, nor a 16-bit param's fp32 master, which is cast into the staging buffer
  first (pinning them would only speed up checkpoint copies).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from zeroshard.layout.flat_buffer import FlatParamBuffer
from zeroshard.layout.partition import ShardPiece

# Set on every virtual parameter, so that a torch optimizer wrapped a second time is recognized.
_VIRTUAL = "_zeroshard_virtual_param"


def is_virtual_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is a virtual parameter of some chunk (see [Note: zeroshard buffers])."""
    return getattr(param, _VIRTUAL, False)


class Chunk:
    """Rank ``rank``'s slice of bucket ``bucket`` of ``buffer``, with the optimizer state it owns.

    Args:
        buffer: the flat param buffer.
        rank: this rank's index in the sharding group.
        bucket: the bucket's index in ``buffer.layout``.
        grad_shard: the shard's grad shard (1-D, master dtype: its dtype is the chunk's master dtype); :attr:`grad` is a view of it.
        pieces: this rank's (param ∩ slice) pieces of the bucket, in flat order.
        on_host: start in host memory (``offload="cpu"``), with a master of its own whatever the param dtype; otherwise on
            the params' device.

    The tensor fields are 1-D with ``numel`` elements unless their comment says otherwise.
    """

    def __init__(self, buffer: FlatParamBuffer, rank: int, bucket: int, grad_shard: Tensor, pieces: Sequence[ShardPiece],
                 on_host: bool = False) -> None:
        layout = buffer.layout
        self.bucket = bucket
        self.numel = layout.buckets[bucket].shard_numel(layout.world_size)  # elements of the slice, padding included
        self.shard_offset = layout.buckets[bucket].shard_offset  # first element of the slice within this rank's shard
        self.master_dtype = grad_shard.dtype  # fp32 for 16-bit params, else (and with master_weights=False) the param dtype
        self.params: Tensor = buffer.slice_view(bucket, rank)  # param dtype: this rank's slice (the input of the bucket's all-gather)
        self.bucket_params: Tensor = buffer.bucket_view(bucket)  # param dtype, padded_numel: the whole bucket (the all-gather's output)
        self.grad: Tensor = grad_shard[self.shard_offset : self.shard_offset + self.numel]  # master dtype: this slice of the grad shard
        self.on_host = on_host  # master and moments in host memory (and the CPU update runs)
        # Master dtype, where the chunk lives; None where params holds the master weights (fp32/fp64 params on their device,
        # 16-bit params with master_weights=False). On the host pinned only as the source of the copy back (fp32/fp64 on CUDA).
        self.master: Tensor | None = None
        if on_host:
            pin = buffer.device.type == "cuda" and self.master_dtype == buffer.dtype
            self.master = torch.empty(self.numel, dtype=self.master_dtype, pin_memory=pin).copy_(self.params)
        elif self.master_dtype != buffer.dtype:
            self.master = torch.empty(self.numel, dtype=self.master_dtype, device=buffer.device).copy_(self.params)
        # Master dtype, where the chunk lives; None until allocate_moments (the fused Adam/AdamW update only: other optimizers keep their own state).
        self.exp_avg: Tensor | None = None
        self.exp_avg_sq: Tensor | None = None
        self.host_grad: Tensor | None = None  # master dtype, host: the copy of grad the CPU update reads; None until used, and on the device
        self.host_param: Tensor | None = None  # param dtype, host, pinned: the cast of the updated master of 16-bit CUDA params; None until used
        self.pieces: list[ShardPiece] = list(pieces)
        self._runs: dict[int, list[tuple[int, int]]] = {}  # see runs()
        self._shapes = {piece.param: buffer.params[piece.param].shape if layout.whole_params else torch.Size([piece.numel]) for piece in self.pieces}
        # One per piece, a view of weights: what the wrapped optimizer steps (1-D, or shaped like the param with partition="param").
        self.virtual_params: list[nn.Parameter] = [nn.Parameter(self.shaped(piece), requires_grad=True) for piece in self.pieces]
        for vparam in self.virtual_params:
            setattr(vparam, _VIRTUAL, True)

    @property
    def device(self) -> torch.device:
        """Where master and moments live: ``cpu`` in host memory, else the params' device."""
        return torch.device("cpu") if self.on_host else self.params.device

    @property
    def weights(self) -> Tensor:
        """1-D, master dtype, ``numel`` elements: the master weights (:attr:`master`, or :attr:`params` where there is none)."""
        return self.params if self.master is None else self.master

    def offset_of(self, piece: ShardPiece) -> int:
        """First element of ``piece`` (one of :attr:`pieces`) within the chunk."""
        return piece.shard_offset - self.shard_offset

    def breaks_run(self, start: int, i: int, unit: int) -> bool:
        """Whether piece ``i`` cannot join a run of adjacent :attr:`pieces` that starts at piece ``start``: it does not follow
        piece ``i - 1`` in the shard, or the run so far is not a whole number of ``unit`` elements."""
        previous, piece = self.pieces[i - 1], self.pieces[i]
        return previous.shard_offset + previous.numel != piece.shard_offset or bool((piece.shard_offset - self.pieces[start].shard_offset) % unit)

    def runs(self, unit: int) -> list[tuple[int, int]]:
        """``[start, end)`` ranges of :attr:`pieces` split where :meth:`breaks_run` (fixed by the layout: computed once per ``unit``)."""
        if unit not in self._runs:
            runs, start = [], 0
            for i in range(1, len(self.pieces)):
                if self.breaks_run(start, i, unit):
                    runs.append((start, i))
                    start = i
            self._runs[unit] = [*runs, (start, len(self.pieces))] if self.pieces else []
        return self._runs[unit]

    def view(self, piece: ShardPiece, of: Tensor | None = None) -> Tensor:
        """1-D view of ``piece``'s elements in ``of``, a per-chunk tensor (default: :attr:`weights`)."""
        start = self.offset_of(piece)
        return (self.weights if of is None else of)[start : start + piece.numel]

    def shaped(self, piece: ShardPiece, of: Tensor | None = None) -> Tensor:
        """:meth:`view`, shaped as ``piece``'s virtual param: 1-D, or the param's shape when the layout holds whole params."""
        return self.view(piece, of).view(self._shapes[piece.param])

    def allocate_moments(self) -> bool:
        """Give the chunk zero ``exp_avg`` and ``exp_avg_sq`` where it lives, unless it has them; whether it had to."""
        if self.exp_avg is not None:
            return False
        self.exp_avg = torch.zeros(self.numel, dtype=self.master_dtype, device=self.device)
        self.exp_avg_sq = torch.zeros(self.numel, dtype=self.master_dtype, device=self.device)
        return True

    def host_grad_buffer(self) -> Tensor:
        """:attr:`host_grad`, allocated on first use (see the pinning rules in the module docstring)."""
        if self.host_grad is None:
            self.host_grad = torch.empty(self.numel, dtype=self.grad.dtype, pin_memory=self.params.device.type == "cuda")
        return self.host_grad

    def host_param_buffer(self) -> Tensor:
        """:attr:`host_param`, allocated on first use (16-bit params on CUDA only)."""
        if self.host_param is None:
            self.host_param = torch.empty(self.numel, dtype=self.params.dtype, pin_memory=True)
        return self.host_param

    @torch.no_grad()
    def move_to_device(self) -> None:
        """Move the chunk from host memory to the params' device (``gpu_margin_mem_ratio``): all of it, or (on error) nothing.

        Only once every copy exists does the chunk switch to them, drop its host buffers and re-point its virtual params (the
        objects the optimizer's state is keyed by) at the new master; fp32/fp64 params drop their master for the flat-buffer
        slice. State entries that viewed the old moments are re-pointed by :meth:`~zeroshard.step.fused_adam.FusedAdam.bind`.

        Raises:
            torch.cuda.OutOfMemoryError: no room on the device; the chunk is left as it was.
        """
        if not self.on_host:
            return
        host_master = self.master
        if host_master is None:
            raise RuntimeError("internal error: a chunk in host memory has no master of its own")
        device = self.params.device
        master = torch.empty(self.numel, dtype=self.master_dtype, device=device).copy_(host_master) if self.master_dtype != self.params.dtype else None
        exp_avg = self.exp_avg.to(device) if self.exp_avg is not None else None
        exp_avg_sq = self.exp_avg_sq.to(device) if self.exp_avg_sq is not None else None
        if master is None:
            self.params.copy_(host_master)
        self.master, self.exp_avg, self.exp_avg_sq = master, exp_avg, exp_avg_sq
        self.host_grad = self.host_param = None
        self.on_host = False
        for piece, vparam in zip(self.pieces, self.virtual_params):
            vparam.data = self.shaped(piece)

    @torch.no_grad()
    def write_back(self) -> None:
        """Cast the master into :attr:`params` (no-op where :attr:`params` is the master)."""
        if self.master is not None:
            self.params.copy_(self.master)

    def owned_tensors(self) -> dict[str, list[Tensor]]:
        """The tensors the chunk owns, by :class:`~zeroshard.MemoryUsage` kind (each storage once; views excluded)."""
        kinds = {"params": (self.host_param,), "grad_shard": (self.host_grad,), "master": (self.master,), "optimizer_state": (self.exp_avg, self.exp_avg_sq)}
        return {kind: [t for t in tensors if t is not None] for kind, tensors in kinds.items()}


def chunks_of(shards: Sequence) -> list[Chunk]:
    """Every chunk of ``shards`` (:class:`~zeroshard.layout.local_shard.LocalShard`) in layout order, the same on every rank."""
    return [chunk for shard in shards for chunk in shard.chunks]
