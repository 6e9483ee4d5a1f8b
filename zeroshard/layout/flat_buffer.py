"""Flat 1-D parameter storage for one (param group, dtype); params become views of it.

[Note: zeroshard buffers]
The terms every module uses (the same list as docs/design.md's glossary; N = sharding degree,
D = data-parallel size, r = this rank):

* **flat param buffer** (1-D, param dtype, on the params' device): all trainable params of one
  param group and dtype, in reverse registration order, bucket after bucket, each bucket padded to
  a multiple of N, each param and bucket starting on a 64-byte boundary (``FlatParamBuffer``).
  The model's params are views of it, so the model always sees full params.
* **bucket** (a contiguous part of a flat buffer): whole params (a param larger than
  ``bucket_size_mb`` gets a bucket of its own); the unit of one gradient reduce-scatter and one
  param all-gather.
* **slice** (a range of indices): rank r's 1/N of one bucket: ``[offset + r*S, offset + (r+1)*S)``
  with ``S`` the padded bucket size over N. With ``partition="param"`` it holds whole params of
  rank r only, and every slice of the bucket is padded to the same ``S``. It names where, not what:
  the tensors that hold a slice form its chunk.
* **shard** (rank r's slices of one flat buffer): everything rank r owns of one flat param buffer,
  all its slices in bucket order (``LocalShard``).
* **piece** (a range of indices): the intersection of one param with one slice (``ShardPiece``); a
  param has one piece on each rank that owns part of it (``partition="param"``: one piece, the
  whole param, on its owner).
* **chunk** (the tensors of one slice): what rank r keeps for one slice (``Chunk``): its master, ``exp_avg``,
  ``exp_avg_sq`` and, offloaded, its host gradient and host param. A chunk lives and moves as a
  whole, on the device or in host memory.
* **run** (adjacent pieces of one chunk): a maximal sequence of adjacent pieces with the same step
  count (on CPU, each starting a whole number of 64-byte cache lines into the run); the fused
  update takes a run in one call.
* **master** (1-D, master dtype (fp32 for bf16/fp16 params)): a chunk's full-precision copy of its
  slice, for 16-bit params and offloaded chunks; for fp32/fp64 params on their device the slice of
  the flat param buffer is the master, with no copy.
* **grad shard** (1-D, master dtype): rank r's gradient for its shard, summed over the D
  data-parallel ranks and divided by D.
* **virtual parameter** (1-D ``nn.Parameter``, master dtype; shaped like its param with
  ``partition="param"``): one per piece, a view of its master.
  The wrapped optimizer's ``param_groups[i]["params"]`` holds these, so it keeps state only for
  this rank's shard, and a ``step`` per piece as it would per param (Rajbhandari et al., "ZeRO",
  SC'20, section 5.1).
* **flat grad buffer** (stage 1 only; 1-D, param dtype): the flat param buffer's layout for
  gradients: the params' ``.grad`` are views of it, so a bucket is reduce-scattered in place.
* **staging bucket** (stage 2 only; 1-D, ``reduce_dtype``): one bucket's gradients, filled as
  params become ready during backward and freed once reduced into the grad shard.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from zeroshard.layout.partition import FlatLayout, bucket_contents, build_layout, param_align


def param_name(group: int, index: int) -> str:
    """How errors and checkpoints name param ``index`` of param group ``group``: ``param_groups[g]['params'][j]``."""
    return f"param_groups[{group}]['params'][{index}]"


def is_sharded(param: nn.Parameter) -> bool:
    """Whether ``param`` goes into a flat buffer: trainable, with elements (others stay in their group, outside every buffer)."""
    return param.requires_grad and param.numel() > 0


class FlatParamBuffer:
    """Flat storage for params of one dtype on one device; binds the params as views of it.

    Args:
        params: trainable params, all of one dtype and device, in layout order (the caller passes reverse registration
            order). Their values are copied into the buffer.
        bucket_numel: soft cap on elements per bucket (see :func:`~zeroshard.layout.partition.build_layout`).
        world_size: sharding degree N; every bucket is padded to a multiple of it.
        names: per param, how errors name it (``param_groups[g]['params'][j]``).
        owners: per param, the rank that holds it whole (``partition="param"``), or ``None`` to lay params out flat.

    Raises:
        ValueError: if the params do not share one dtype and device (see ``build_layout`` for the size checks).
    """

    def __init__(self, params: Sequence[nn.Parameter], bucket_numel: int, world_size: int, names: Sequence[str] | None = None,
                 owners: Sequence[int] | None = None) -> None:
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(f"a flat buffer needs params of one dtype and device; got {kinds}")
        self.params = list(params)  # in layout order; params[i].data is param_view(i)
        self.names = list(names) if names is not None else [f"param {i}" for i in range(len(self.params))]
        self.bucket_numel = bucket_numel  # the cap it was laid out with
        self.layout: FlatLayout = build_layout([p.numel() for p in params], bucket_numel, world_size, owners, param_align(params[0].element_size()))
        first = self.params[0]
        self.data: Tensor = torch.zeros(self.layout.numel, dtype=first.dtype, device=first.device)  # 1-D, layout.numel elements; padding is zero
        self._expected: tuple[int, list[int], list[int]] | None = None  # (data's address, each slot's address, each slot's size)
        with torch.no_grad():
            for index, param in enumerate(self.params):
                view = self.param_view(index)
                view.copy_(param.detach().reshape(-1))
                param.data = view.view_as(param)

    @property
    def dtype(self) -> torch.dtype:
        """The params' dtype."""
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        """The params' device."""
        return self.data.device

    def packed(self) -> bool:
        """Whether each bucket holds what it did with params packed end to end (no ``align``: sharded format version 2)."""
        numels = [p.numel() for p in self.params]
        return self.layout.whole_params or bucket_contents(self.layout) == bucket_contents(build_layout(numels, self.bucket_numel, self.layout.world_size))

    def param_view(self, index: int, of: Tensor | None = None) -> Tensor:
        """1-D view of param ``index`` in ``of``, any 1-D tensor with this buffer's layout (default: the flat param buffer)."""
        slot = self.layout.slots[index]
        return (self.data if of is None else of)[slot.offset : slot.offset + slot.numel]

    def bucket_view(self, bucket: int, of: Tensor | None = None) -> Tensor:
        """1-D view of bucket ``bucket`` (padding included) in ``of`` (default: the flat param buffer)."""
        b = self.layout.buckets[bucket]
        return (self.data if of is None else of)[b.offset : b.offset + b.padded_numel]

    def moved(self) -> list[int]:
        """The indices of the params no longer views of their slot (:meth:`follow` re-binds them), checked at once as lists."""
        base, size, dtype = self.data.data_ptr(), self.data.element_size(), self.data.dtype
        if self._expected is None or self._expected[0] != base:
            self._expected = (base, [base + slot.offset * size for slot in self.layout.slots], [slot.numel for slot in self.layout.slots])
        _, addresses, numels = self._expected
        if [p.data_ptr() for p in self.params] == addresses and all(p.dtype is dtype for p in self.params) and [p.numel() for p in self.params] == numels:
            return []
        return [i for i, p in enumerate(self.params) if p.data_ptr() != addresses[i] or p.dtype is not dtype or p.numel() != numels[i]]

    def follow(self, index: int) -> bool:
        """Re-bind param ``index`` as a view of the buffer if its storage was replaced; whether it was.

        ``model.to(...)``, ``.cpu()``, ``.to("cpu:0")`` under torchrun (what HF Trainer and accelerate do) and ``param.data = ...``
        keep the ``Parameter`` object but give it new storage, which the buffer's updates would no longer reach. The param's
        current values win: they are copied into the buffer, and the param becomes its view again.

        Raises:
            RuntimeError: the param now has another device, dtype or shape, which a buffer built for the old ones cannot
                follow; names the param and says what to do.
        """
        param, slot, data = self.params[index], self.layout.slots[index], self.data
        # Still a view of its slot (the common case, checked every step without making a view; an address inside this buffer is on its device).
        if param.data_ptr() == data.data_ptr() + slot.offset * data.element_size() and param.dtype is data.dtype and param.numel() == slot.numel:
            return False
        view = self.param_view(index)
        if param.device != view.device or param.dtype != view.dtype or param.numel() != view.numel():
            raise RuntimeError(
                f"{self.names[index]} (shape {tuple(param.shape)}) is now {param.dtype} on {param.device}, but the optimizer was built "
                f"for {view.dtype} on {view.device} with {view.numel()} elements: zeroshard cannot follow a change of device, dtype or size. "
                "Move or cast the model first, then build the optimizer (model.to(...); opt = ShardedOptimizer(...))"
            )
        with torch.no_grad():
            view.copy_(param.detach().reshape(-1))
            param.data = view.view_as(param)
        return True

    def slice_view(self, bucket: int, rank: int) -> Tensor:
        """1-D view of ``rank``'s slice of bucket ``bucket`` in the flat param buffer."""
        start, end = self.layout.buckets[bucket].rank_range(rank, self.layout.world_size)
        return self.data[start:end]
