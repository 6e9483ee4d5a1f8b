"""This rank's part of one flat param buffer: its chunks, grad shard and virtual params ([Note: zeroshard buffers] in
``zeroshard/layout/flat_buffer.py``)."""

from __future__ import annotations

import bisect
import operator
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from zeroshard.compat import DisableTorchFunctionSubclass
from zeroshard.layout.chunk import Chunk
from zeroshard.layout.flat_buffer import FlatParamBuffer
from zeroshard.layout.partition import ShardPiece

_GRAD = operator.attrgetter("grad")


class LocalShard:
    """Rank ``rank``'s chunks (one :class:`~zeroshard.layout.chunk.Chunk` per bucket) of one flat buffer, and what spans them:
    the grad shard, the pieces and virtual params in flat order, the params' versions (to refresh masters after outside writes).

    Args:
        buffer: the flat param buffer this shard belongs to.
        rank: this rank's index in the sharding group.
        host_master: start every chunk in host memory with a master of its own, whatever the param dtype (CPU offload; see
            ``zeroshard/layout/chunk.py`` for which buffers are pinned).
        group: the index of the wrapped optimizer's param group the params belong to.
        param_indices: per param of ``buffer`` (layout order), its ``torch.optim`` index (params numbered across param groups
            in order, as ``state_dict()`` numbers them); default ``0, 1, ...``.
        master_weights: keep fp32 master weights for 16-bit params (``False``: the params are the master weights, and the
            grad shard and virtual params take their dtype).
    """

    def __init__(self, buffer: FlatParamBuffer, rank: int, host_master: bool = False, group: int = 0, param_indices: list[int] | None = None,
                 master_weights: bool = True) -> None:
        self.buffer = buffer
        self.rank = rank
        self.group = group
        self.param_indices = list(range(len(buffer.params))) if param_indices is None else param_indices
        layout = buffer.layout
        self.pieces: list[ShardPiece] = layout.pieces(rank)  # the (param ∩ slice) pieces this rank owns, in flat order
        self.master_dtype = torch.float32 if master_weights and buffer.dtype.itemsize < 4 else buffer.dtype  # else the params are the master weights
        self._bucket_starts = [b.shard_offset for b in layout.buckets]
        # 1-D master dtype, layout.shard_numel elements: this rank's reduced, averaged gradient (padding positions stay zero).
        self.grad_shard: Tensor = torch.zeros(layout.shard_numel, dtype=self.master_dtype, device=buffer.device)
        pieces_of: list[list[ShardPiece]] = [[] for _ in layout.buckets]
        for piece in self.pieces:
            pieces_of[layout.slots[piece.param].bucket].append(piece)
        self.chunks: list[Chunk] = [Chunk(buffer, rank, b.index, self.grad_shard, pieces_of[b.index], on_host=host_master) for b in layout.buckets]
        self.virtual_params: list[nn.Parameter] = [vparam for chunk in self.chunks for vparam in chunk.virtual_params]  # the chunks', in flat order
        # Between steps each virtual param's .grad is a VirtualGrad (grad.sharded_grad.bind_virtual_grads): a framework clipping
        # the optimizer's param_groups would take None for "nothing to clip". Typed loosely: grad/ sits above layout/.
        self.idle_grads: list[Tensor] = []
        self.amp_link: object | None = None  # the optimizer's GradScalerLink, handed to each idle grad
        self.grads_moved = False  # an idle grad's .data was set since take_replaced_grads (VirtualGrad.__torch_function__)
        self._seen_versions = [p._version for p in buffer.params]

    @property
    def has_master(self) -> bool:
        """Whether any chunk keeps master weights apart from the flat param buffer."""
        return any(chunk.master is not None for chunk in self.chunks)

    def master_slice(self, bucket: int) -> Tensor:
        """1-D view of this rank's master weights for bucket ``bucket`` (its chunk's :attr:`~zeroshard.layout.chunk.Chunk.weights`)."""
        return self.chunks[bucket].weights

    def master_view(self, offset: int, numel: int) -> Tensor:
        """1-D view of master elements ``[offset, offset + numel)`` of the shard, which must lie in one chunk."""
        chunk = self.chunks[bisect.bisect_right(self._bucket_starts, offset) - 1]
        start = offset - chunk.shard_offset
        return chunk.weights[start : start + numel]

    def grad_slice(self, bucket: int) -> Tensor:
        """1-D view of the grad shard for this rank's slice of bucket ``bucket`` (its chunk's :attr:`~zeroshard.layout.chunk.Chunk.grad`)."""
        return self.chunks[bucket].grad

    def follow(self, index: int) -> None:
        """Re-bind param ``index`` if its storage was replaced (:meth:`FlatParamBuffer.follow`); its master is then refreshed at the next step."""
        if self.buffer.follow(index):
            self._seen_versions[index] = -1

    def follow_all(self) -> None:
        """:meth:`follow` for every param of the buffer (checked in one pass: :meth:`FlatParamBuffer.moved`)."""
        for index in self.buffer.moved():
            self.follow(index)

    @torch.no_grad()
    def refresh_master(self) -> None:
        """Re-copy master elements of params written outside the optimizer (e.g. ``load_state_dict``), seen by their version
        counters (the optimizer writes only to the flat buffer, which has its own). Only elements that no longer equal the master
        rounded to the param dtype are refreshed, so loading a checkpoint's params and fp32 master (in either order) keeps its precision.
        """
        if not self.has_master:
            return
        params = self.buffer.params
        changed = {i for i, p in enumerate(params) if p._version != self._seen_versions[i]}
        if not changed:
            return
        for chunk in self.chunks:
            if chunk.master is None:
                continue
            for piece in chunk.pieces:
                if piece.param in changed:
                    master = chunk.view(piece)
                    current = chunk.view(piece, chunk.params).to(master.device)
                    stale = current != master.to(current.dtype)
                    master[stale] = current[stale].to(master.dtype)
        for i in changed:
            self._seen_versions[i] = params[i]._version

    def attach_grads(self, used: Sequence[bool]) -> None:
        """Point each virtual param's ``.grad`` at its grad-shard piece, or ``None`` where param ``i`` got no gradient on any
        rank since the last step (``used[i]``): as in ``torch.optim``, it is skipped, its state untouched."""
        for piece, vparam in zip(self.pieces, self.virtual_params):
            vparam.grad = self.grad_piece(piece, vparam.shape) if used[piece.param] else None

    def grad_piece(self, piece: ShardPiece, shape: torch.Size) -> Tensor:
        """``piece``'s slice of the grad shard, viewed in its virtual param's ``shape``."""
        return self.grad_shard[piece.shard_offset : piece.shard_offset + piece.numel].view(shape)

    @torch.no_grad()
    def take_replaced_grads(self, write: bool = True) -> None:
        """At ``step()`` (and a clip): follow a ``.grad`` that user code gave a virtual param since this step's first backward,
        as ``torch.optim`` would step it (``p.grad = p.grad.clamp(-1, 1)`` over ``param_groups``): its values go into the
        piece's slice of the grad shard, and the param gets its between-step ``.grad`` back. ``write=False``: only the checks.

        Raises:
            RuntimeError: one set to ``None`` (``torch.optim`` would skip that param; here it is a piece of a model param,
                which the other ranks step), or to a tensor of another shape, naming the param.
        """
        grads = list(map(_GRAD, self.virtual_params))
        if not self.grads_moved and all(map(operator.is_, grads, self.idle_grads)):
            return  # nothing replaced (one pass in C)
        moved: set[int] = set()
        if self.grads_moved:  # a VirtualGrad's .data was set: which ones hold other storage now (offload: elsewhere)
            base, size = self.grad_shard.data_ptr(), self.grad_shard.element_size()
            with DisableTorchFunctionSubclass():
                moved = {i for i, (piece, idle) in enumerate(zip(self.pieces, self.idle_grads))
                         if idle.device == self.grad_shard.device and idle.data_ptr() != base + piece.shard_offset * size}
        for i, (piece, vparam, idle, grad) in enumerate(zip(self.pieces, self.virtual_params, self.idle_grads, grads)):
            if grad is idle and i not in moved:
                continue
            if grad is None or grad.shape != vparam.shape:
                found = "None" if grad is None else f"a tensor of shape {tuple(grad.shape)}"
                raise RuntimeError(f"a virtual param of {self.buffer.names[piece.param]} (one of optimizer.param_groups' params, shape "
                                   f"{tuple(vparam.shape)}) was given .grad = {found} after the backward: its gradient cannot be dropped "
                                   "or reshaped there. Edit it in place, or set the model param's .grad (model.parameters()) instead")
            if not write:
                continue
            values, home = grad.detach(), self.grad_piece(piece, vparam.shape)
            if grad is idle:  # grad.data = t: followed the same way, and the VirtualGrad is its piece of the grad shard again
                values = values.clone()
                with DisableTorchFunctionSubclass():
                    idle.data = home
            home.copy_(values)
            vparam.grad = idle
        if write:
            self.grads_moved = False

    def detach_grads(self) -> None:
        """Give the virtual params their between-step ``.grad`` s (:attr:`idle_grads`) again (after ``attach_grads``)."""
        if all(map(operator.is_, map(_GRAD, self.virtual_params), self.idle_grads)):
            return  # as they are (one pass in C)
        for vparam, idle in zip(self.virtual_params, self.idle_grads):
            vparam.grad = idle

    @torch.no_grad()
    def write_back(self) -> None:
        """Cast the updated master slices into this rank's slices of the flat param buffer."""
        for chunk in self.chunks:
            chunk.write_back()
