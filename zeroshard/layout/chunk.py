"""A chunk: this rank's slice of one bucket, the unit that owns and moves optimizer state.

See [Note: zeroshard buffers] in ``zeroshard/layout/flat_buffer.py``.

A :class:`Chunk` owns everything of its slice that is neither the flat param buffer nor the grad
shard (both of which it only views): the master weights, the Adam moments of the fused update,
with offload the host copy of its gradient and the pinned staging of its params, and the virtual
params that are views of its master. All of it lives in one place, the params' device or host
memory (``offload="cpu"``), and moves there as a whole (:meth:`Chunk.move_to_device`, used by
``gpu_margin_mem_ratio``: see ``zeroshard/offload/placement.py``).

Pinning rules. Page-locked memory is scarce, so only what crosses PCIe every step is pinned, and
only when the params are on CUDA (a CPU-only run has nothing to copy to or from):

* the host copy of a chunk's gradient (:func:`host_grad_buffer`): the destination of the
  device → host copy;
* the source of the copy back: the host master itself for fp32/fp64 params
  (:func:`host_master_buffer`), or, for 16-bit params, a staging buffer in the param dtype that
  receives the cast of the updated master (:func:`host_param_buffer`);
* never the moments, which do not leave the host, nor a 16-bit param's fp32 master, which is
  cast into the staging buffer first (pinning them would only speed up checkpoint copies).
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


def master_dtype_for(dtype: torch.dtype, master_weights: bool = True) -> torch.dtype:
    """The dtype of the master weights for params of ``dtype``: fp32 for 16-bit floats, else ``dtype``;
    ``dtype`` itself without ``master_weights`` (the params are the master weights)."""
    return torch.float32 if master_weights and dtype.itemsize < 4 else dtype


def host_grad_buffer(numel: int, dtype: torch.dtype, params_device: torch.device) -> Tensor:
    """An empty 1-D host tensor of ``numel`` elements of ``dtype`` for a chunk's gradient copy; pinned when ``params_device`` is CUDA."""
    return torch.empty(numel, dtype=dtype, pin_memory=params_device.type == "cuda")


def host_master_buffer(numel: int, dtype: torch.dtype, params_device: torch.device, param_dtype: torch.dtype) -> Tensor:
    """An empty 1-D host tensor for a chunk's master weights (``dtype``, the master dtype).

    Pinned only where it is the source of the copy back to the device: params on CUDA whose
    dtype is the master dtype (fp32, fp64). A 16-bit param's master is cast into
    :func:`host_param_buffer` first, so it stays pageable.
    """
    return torch.empty(numel, dtype=dtype, pin_memory=params_device.type == "cuda" and dtype == param_dtype)


def host_param_buffer(numel: int, param_dtype: torch.dtype) -> Tensor:
    """An empty pinned 1-D host tensor (``param_dtype``, 16-bit) for the cast of a chunk's updated master on its way to CUDA."""
    return torch.empty(numel, dtype=param_dtype, pin_memory=True)


class Chunk:
    """Rank ``rank``'s slice of bucket ``bucket`` of ``buffer``, with the optimizer state it owns.

    Args:
        buffer: the flat param buffer.
        rank: this rank's index in the sharding group.
        bucket: the bucket's index in ``buffer.layout``.
        grad_shard: the shard's grad shard (1-D, master dtype: its dtype is the chunk's master dtype);
            :attr:`grad` is a view of it.
        pieces: this rank's (param ∩ slice) pieces of the bucket, in flat order.
        on_host: start in host memory (``offload="cpu"``), with a master of its own whatever the
            param dtype; otherwise on the params' device.

    Attributes:
        bucket: the bucket's index.
        numel: elements of the slice (``bucket.shard_numel(N)``), padding included.
        shard_offset: first element of the slice within this rank's shard.
        master_dtype: the grad shard's dtype: fp32 for 16-bit params, else (and with
            ``master_weights=False``) the param dtype.
        params: 1-D, param dtype, ``numel`` elements: this rank's slice of the flat param buffer
            (the input of the bucket's all-gather).
        bucket_params: 1-D, param dtype, ``bucket.padded_numel`` elements: the whole bucket in the
            flat param buffer (the output of its all-gather).
        grad: 1-D, master dtype, ``numel`` elements: this slice of the grad shard.
        master: 1-D, master dtype, ``numel`` elements, where the chunk lives; ``None`` where
            :attr:`params` holds the master weights (fp32/fp64 params on their device, and 16-bit
            params with ``master_weights=False``).
        exp_avg, exp_avg_sq: 1-D, master dtype, ``numel`` elements, where the chunk lives; ``None``
            until :meth:`allocate_moments` (the fused Adam/AdamW update only; other optimizers
            keep their state themselves).
        host_grad: 1-D, master dtype, ``numel`` elements in host memory (pinned with CUDA
            params): the copy of :attr:`grad` the CPU update reads; ``None`` until the first
            offloaded update that uses it, and on the device.
        host_param: 1-D, param dtype, ``numel`` elements, pinned: staging for the cast of the
            updated master of 16-bit CUDA params on their way back; ``None`` until used.
        pieces: the pieces, in flat order.
        virtual_params: one ``nn.Parameter`` per piece, a view of :attr:`weights`; what the
            wrapped optimizer steps (its state is keyed by them). 1-D, or with whole params
            (``partition="param"``) shaped like the param (:meth:`shaped`).
        on_host: whether master and moments are in host memory (and the CPU update runs).
    """

    def __init__(self, buffer: FlatParamBuffer, rank: int, bucket: int, grad_shard: Tensor, pieces: Sequence[ShardPiece],
                 on_host: bool = False) -> None:
        layout = buffer.layout
        self.bucket = bucket
        self.numel = layout.buckets[bucket].shard_numel(layout.world_size)
        self.shard_offset = layout.buckets[bucket].shard_offset
        self.master_dtype = grad_shard.dtype
        self.params: Tensor = buffer.slice_view(bucket, rank)  # 1D param dtype, this rank's slice
        self.bucket_params: Tensor = buffer.bucket_view(bucket)  # 1D param dtype, the whole bucket with padding
        self.grad: Tensor = grad_shard[self.shard_offset : self.shard_offset + self.numel]  # 1D master dtype
        self.on_host = on_host
        self.master: Tensor | None = None  # 1D master dtype, where the chunk lives; None: params is the master
        if on_host:
            self.master = host_master_buffer(self.numel, self.master_dtype, buffer.device, buffer.dtype).copy_(self.params)
        elif self.master_dtype != buffer.dtype:
            self.master = torch.empty(self.numel, dtype=self.master_dtype, device=buffer.device).copy_(self.params)
        self.exp_avg: Tensor | None = None  # 1D master dtype, where the chunk lives
        self.exp_avg_sq: Tensor | None = None  # 1D master dtype, where the chunk lives
        self.host_grad: Tensor | None = None  # 1D master dtype, host (pinned with CUDA params)
        self.host_param: Tensor | None = None  # 1D param dtype, host, pinned
        self.pieces: list[ShardPiece] = list(pieces)
        self._shapes = {piece.param: buffer.params[piece.param].shape if layout.whole_params else torch.Size([piece.numel]) for piece in self.pieces}
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
            self.host_grad = host_grad_buffer(self.numel, self.grad.dtype, self.params.device)
        return self.host_grad

    def host_param_buffer(self) -> Tensor:
        """:attr:`host_param`, allocated on first use (16-bit params on CUDA only)."""
        if self.host_param is None:
            self.host_param = host_param_buffer(self.numel, self.params.dtype)
        return self.host_param

    @torch.no_grad()
    def move_to_device(self) -> None:
        """Move the chunk from host memory to the params' device: all of it, or (on error) nothing.

        Master and moments are copied to the device first; only once every copy exists does the
        chunk switch to them, drop its host gradient copy and staging, and re-point its virtual
        params (the same objects, which the wrapped optimizer's state is keyed by) at the new
        master. fp32/fp64 params drop their master: the flat-buffer slice, which holds the same
        values after every step, takes its place. Entries of the wrapped optimizer's state that
        were views of the old moments must be re-pointed by their owner
        (:meth:`zeroshard.step.fused_adam.FusedAdam.bind`). No-op on the device.

        Raises:
            torch.cuda.OutOfMemoryError: no room on the device; the chunk is left as it was.
        """
        if not self.on_host:
            return
        host_master = self.master
        if host_master is None:
            raise RuntimeError("internal error: a chunk in host memory has no master of its own")
        device = self.params.device
        master = None
        if self.master_dtype != self.params.dtype:
            master = torch.empty(self.numel, dtype=self.master_dtype, device=device).copy_(host_master)
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
        return {
            "params": [t for t in (self.host_param,) if t is not None],
            "grad_shard": [t for t in (self.host_grad,) if t is not None],
            "master": [t for t in (self.master,) if t is not None],
            "optimizer_state": [t for t in (self.exp_avg, self.exp_avg_sq) if t is not None],
        }


def chunks_of(shards: Sequence) -> list[Chunk]:
    """Every chunk of ``shards`` (:class:`~zeroshard.layout.local_shard.LocalShard`) in layout order:
    shard by shard, bucket by bucket; the same on every rank."""
    return [chunk for shard in shards for chunk in shard.chunks]
