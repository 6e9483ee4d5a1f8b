"""This rank's part of one flat param buffer: master pieces, grad shard, virtual params.

See [Note: zeroshard buffers] in ``zeroshard/flat_buffer.py``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from zeroshard.flat_buffer import FlatParamBuffer
from zeroshard.partition import ShardPiece
from zeroshard.reduced_grad import VIRTUAL, reduced_grad


# Set on every virtual parameter, so that a torch optimizer wrapped a second time is recognized.
_VIRTUAL = "_zeroshard_virtual_param"


def is_virtual_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is a virtual parameter of some :class:`LocalShard` (see [Note: zeroshard buffers])."""
    return getattr(param, _VIRTUAL, False)


def master_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the master weights for params of ``dtype``: fp32 for 16-bit floats, else ``dtype``."""
    return torch.float32 if dtype.itemsize < 4 else dtype


class LocalShard:
    """Rank ``rank``'s master weights, gradient shard and virtual params for one flat buffer.

    The master weights are kept per *chunk*: this rank's slice of one bucket. Each chunk's master
    is a tensor of its own, so :meth:`place_master` can move one chunk between host and device
    memory (``gpu_margin_mem_ratio``) without touching the others.

    Args:
        buffer: the flat param buffer this shard belongs to.
        rank: this rank's index in the sharding group.
        host_master: keep the master weights in host memory as a separate copy, whatever the
            param dtype (CPU offload; pinned when the params are fp32 on CUDA, for the DMA copy).

    Attributes:
        pieces: the (param ∩ slice) pieces this rank owns, in flat order.
        masters: per bucket, 1-D fp32 (or the param dtype for fp32/fp64 params with
            ``host_master``) with ``bucket.shard_numel(N)`` elements; ``None`` where the
            flat-buffer slice itself holds the master weights (fp32/fp64 params on their device).
        grad_shard: 1-D master dtype, ``layout.shard_numel`` elements: this rank's reduced,
            averaged gradient (padding positions stay zero).
        virtual_params: one 1-D ``nn.Parameter`` per piece, a view of the master weights; what
            the wrapped optimizer steps.
    """

    def __init__(self, buffer: FlatParamBuffer, rank: int, host_master: bool = False) -> None:
        self.buffer = buffer
        self.rank = rank
        layout = buffer.layout
        self.pieces: list[ShardPiece] = layout.pieces(rank)
        self.master_dtype = master_dtype_for(buffer.dtype)
        self.masters: list[Tensor | None] = [None] * len(layout.buckets)
        self._bucket_starts = [b.shard_offset for b in layout.buckets]
        for b in layout.buckets:
            if host_master:
                self._set_master(b.index, torch.device("cpu"))
            elif self.master_dtype != buffer.dtype:
                self._set_master(b.index, buffer.device)
        self.grad_shard: Tensor = torch.zeros(layout.shard_numel, dtype=self.master_dtype, device=buffer.device)
        self.virtual_params: list[nn.Parameter] = [
            nn.Parameter(self.master_view(piece.shard_offset, piece.numel), requires_grad=True) for piece in self.pieces
        ]
        for vparam in self.virtual_params:
            setattr(vparam, _VIRTUAL, True)
        # Between steps each virtual param's .grad says where its gradient is instead of None,
        # which a framework clipping the optimizer's param_groups would take for "nothing to clip".
        self._idle_grads = [reduced_grad(vparam, buffer.names[piece.param], VIRTUAL) for piece, vparam in zip(self.pieces, self.virtual_params)]
        self.detach_grads()
        self._seen_versions = [p._version for p in buffer.params]

    @property
    def has_master(self) -> bool:
        """Whether any chunk keeps master weights apart from the flat param buffer."""
        return any(m is not None for m in self.masters)

    def _set_master(self, bucket: int, device: torch.device) -> None:
        """Give chunk ``bucket`` a master of its own on ``device``, holding the current master values."""
        # Pinned only where it is a DMA source: an fp32 master is copied to the device as it is;
        # a 16-bit param's master is cast into a pinned staging buffer first (FusedAdam.host_param).
        pin = device.type == "cpu" and self.buffer.device.type == "cuda" and self.master_dtype == self.buffer.dtype
        size = self.buffer.layout.buckets[bucket].shard_numel(self.buffer.layout.world_size)
        master = torch.empty(size, dtype=self.master_dtype, device=device, pin_memory=pin)
        master.copy_(self.master_slice(bucket))
        self.masters[bucket] = master

    @torch.no_grad()
    def place_master(self, bucket: int, on_host: bool) -> None:
        """Move chunk ``bucket``'s master weights to host memory or to the params' device; re-point its virtual params.

        In host memory the chunk always has a separate master (pinned for fp32 params on CUDA).
        On the params' device, fp32/fp64 params drop it: the flat-buffer slice, which holds the
        same values after every step, takes its place. The virtual params stay the same objects
        (the wrapped optimizer's state is keyed by them); their ``.data`` becomes a view of the
        new storage.

        Raises:
            torch.cuda.OutOfMemoryError: no room on the device; the chunk is left as it was.
        """
        current = self.masters[bucket]
        if on_host:
            if current is None or current.device.type != "cpu":
                self._set_master(bucket, torch.device("cpu"))
        elif self.master_dtype == self.buffer.dtype:
            if current is not None:
                self.buffer.slice_view(bucket, self.rank).copy_(current)
            self.masters[bucket] = None
        elif current is None or current.device != self.buffer.device:
            self._set_master(bucket, self.buffer.device)
        for piece, vparam in zip(self.pieces, self.virtual_params):
            if self.bucket_of(piece) == bucket:
                vparam.data = self.master_view(piece.shard_offset, piece.numel)

    def bucket_of(self, piece: ShardPiece) -> int:
        """The bucket (chunk) holding ``piece``."""
        return self.buffer.layout.slots[piece.param].bucket

    def master_slice(self, bucket: int) -> Tensor:
        """1-D view of this rank's master weights for bucket ``bucket`` (its chunk)."""
        master = self.masters[bucket]
        return self.buffer.slice_view(bucket, self.rank) if master is None else master

    def master_view(self, offset: int, numel: int) -> Tensor:
        """1-D view of master elements ``[offset, offset + numel)`` of the shard, which must lie in one chunk."""
        bucket = bisect.bisect_right(self._bucket_starts, offset) - 1
        start = offset - self.buffer.layout.buckets[bucket].shard_offset
        return self.master_slice(bucket)[start : start + numel]

    def grad_slice(self, bucket: int) -> Tensor:
        """1-D view of the grad shard for this rank's slice of bucket ``bucket``."""
        b = self.buffer.layout.buckets[bucket]
        size = b.shard_numel(self.buffer.layout.world_size)
        return self.grad_shard[b.shard_offset : b.shard_offset + size]

    def follow(self, index: int) -> None:
        """Re-bind param ``index`` if its storage was replaced (:meth:`FlatParamBuffer.follow`); its master is then refreshed at the next step."""
        if self.buffer.follow(index):
            self._seen_versions[index] = -1

    def follow_all(self) -> None:
        """:meth:`follow` for every param of the buffer."""
        for index in range(len(self.buffer.params)):
            self.follow(index)

    @torch.no_grad()
    def refresh_master(self) -> None:
        """Re-copy master elements of params written outside the optimizer (e.g. ``load_state_dict``).

        A param's version counter moves on every in-place write to it (``p.copy_``, ``p.mul_``),
        while the optimizer writes only to the flat buffer, which has its own counter. Only chunks
        with a separate master (16-bit params, offload) need it, and of those only the elements
        whose value no longer equals the master rounded to the param dtype are refreshed, so
        loading a checkpoint's params and its fp32 master (in either order) keeps the master's
        precision.
        """
        if not self.has_master:
            return
        params = self.buffer.params
        changed = {i for i, p in enumerate(params) if p._version != self._seen_versions[i]}
        if not changed:
            return
        for piece in self.pieces:
            if piece.param in changed and self.masters[self.bucket_of(piece)] is not None:
                master = self.master_view(piece.shard_offset, piece.numel)
                current = self.buffer.data[piece.flat_offset : piece.flat_offset + piece.numel].to(master.device)
                stale = current != master.to(current.dtype)
                master[stale] = current[stale].to(master.dtype)
        for i in changed:
            self._seen_versions[i] = params[i]._version

    def attach_grads(self, used: Sequence[bool]) -> None:
        """Point each virtual param's ``.grad`` at its grad-shard piece, or ``None`` where unused.

        ``used[i]`` says whether param ``i`` got a gradient on any rank since the last step; as in
        ``torch.optim``, a param without one is skipped, its state untouched.
        """
        for piece, vparam in zip(self.pieces, self.virtual_params):
            if used[piece.param]:
                vparam.grad = self.grad_shard[piece.shard_offset : piece.shard_offset + piece.numel]
            else:
                vparam.grad = None

    def detach_grads(self) -> None:
        """Replace the virtual params' ``.grad`` views by ReducedGrads (the grad shard itself is kept)."""
        for vparam, idle in zip(self.virtual_params, self._idle_grads):
            vparam.grad = idle

    @torch.no_grad()
    def write_back(self) -> None:
        """Cast the updated master slices into this rank's slices of the flat param buffer."""
        for b, master in enumerate(self.masters):
            if master is not None:
                self.buffer.slice_view(b, self.rank).copy_(master)
