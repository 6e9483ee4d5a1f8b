"""This rank's part of one flat param buffer: master pieces, grad shard, virtual params.

See [Note: zeroshard buffers] in ``zeroshard/flat_buffer.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from zeroshard.flat_buffer import FlatParamBuffer
from zeroshard.partition import ShardPiece


def master_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the master weights for params of ``dtype``: fp32 for 16-bit floats, else ``dtype``."""
    return torch.float32 if dtype.itemsize < 4 else dtype


class LocalShard:
    """Rank ``rank``'s master weights, gradient shard and virtual params for one flat buffer.

    Args:
        buffer: the flat param buffer this shard belongs to.
        rank: this rank's index in the sharding group.
        host_master: keep the master weights in host memory as a separate copy, whatever the
            param dtype (CPU offload; pinned when the params are on CUDA).

    Attributes:
        pieces: the (param ∩ slice) pieces this rank owns, in flat order.
        master: 1-D fp32, ``layout.shard_numel`` elements, for bf16/fp16 params or with
            ``host_master``; ``None`` when the params are fp32/fp64 on their own device, whose
            flat-buffer slices are the master weights.
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
        dtype = master_dtype_for(buffer.dtype)
        self.master: Tensor | None = None
        if host_master:
            pin = buffer.device.type == "cuda"
            self.master = torch.empty(layout.shard_numel, dtype=dtype, device="cpu", pin_memory=pin)
            for b in layout.buckets:
                self._master_slice(b.index).copy_(buffer.slice_view(b.index, rank))
        elif dtype != buffer.dtype:
            self.master = torch.empty(layout.shard_numel, dtype=dtype, device=buffer.device)
            for b in layout.buckets:
                self._master_slice(b.index).copy_(buffer.slice_view(b.index, rank))
        self.grad_shard: Tensor = torch.zeros(layout.shard_numel, dtype=dtype, device=buffer.device)
        self.virtual_params: list[nn.Parameter] = [
            nn.Parameter(self._master_piece(piece), requires_grad=True) for piece in self.pieces
        ]
        self._seen_versions = [p._version for p in buffer.params]

    def _master_slice(self, bucket: int) -> Tensor:
        """1-D view of this rank's master weights for bucket ``bucket``."""
        if self.master is None:
            return self.buffer.slice_view(bucket, self.rank)
        b = self.buffer.layout.buckets[bucket]
        size = b.shard_numel(self.buffer.layout.world_size)
        return self.master[b.shard_offset : b.shard_offset + size]

    def _master_piece(self, piece: ShardPiece) -> Tensor:
        if self.master is None:
            return self.buffer.data[piece.flat_offset : piece.flat_offset + piece.numel]
        return self.master[piece.shard_offset : piece.shard_offset + piece.numel]

    def grad_slice(self, bucket: int) -> Tensor:
        """1-D view of the grad shard for this rank's slice of bucket ``bucket``."""
        b = self.buffer.layout.buckets[bucket]
        size = b.shard_numel(self.buffer.layout.world_size)
        return self.grad_shard[b.shard_offset : b.shard_offset + size]

    @torch.no_grad()
    def refresh_master(self) -> None:
        """Re-copy master elements of params written outside the optimizer (e.g. ``load_state_dict``).

        A param's version counter moves on every in-place write to it (``p.copy_``, ``p.mul_``),
        while the optimizer writes only to the flat buffer, which has its own counter. Only 16-bit
        params have a separate master, and of those only the elements whose value no longer
        equals the master rounded to the param dtype are refreshed, so loading a checkpoint's
        params and its fp32 master (in either order) keeps the master's precision.
        """
        if self.master is None:
            return
        params = self.buffer.params
        changed = {i for i, p in enumerate(params) if p._version != self._seen_versions[i]}
        if not changed:
            return
        for piece in self.pieces:
            if piece.param in changed:
                master = self._master_piece(piece)
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
        """Drop the virtual params' ``.grad`` views (the grad shard itself is kept)."""
        for vparam in self.virtual_params:
            vparam.grad = None

    @torch.no_grad()
    def write_back(self) -> None:
        """Cast the updated master slices into this rank's slices of the flat param buffer."""
        if self.master is None:
            return
        for b in self.buffer.layout.buckets:
            self.buffer.slice_view(b.index, self.rank).copy_(self._master_slice(b.index))
