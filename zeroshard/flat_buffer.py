"""Flat 1-D parameter storage for one (param group, dtype); params become views of it.

[Note: zeroshard buffers]
Every tensor zeroshard keeps is one of these (N = sharding degree, r = this rank):

* **flat param buffer** (:class:`FlatParamBuffer`, ``data``): 1-D, param dtype, on the params'
  device. All trainable params of one param group and dtype, laid out in reverse registration
  order, bucket after bucket, each bucket padded to a multiple of N. The model's params are
  views of it (``p.data = buffer.param_view(i)``), so the model sees full params at all times.
* **bucket**: a contiguous run of the flat param buffer holding whole params; the unit of one
  reduce-scatter (gradients) and one all-gather (params). See ``zeroshard/partition.py``.
* **slice**: rank r's ``1/N`` of one bucket, ``[offset + r*S, offset + (r+1)*S)``.
* **shard**: the concatenation of rank r's slices of all buckets of one flat buffer.
* **grad shard** (``LocalShard.grad_shard``): 1-D, master dtype (fp32 for bf16/fp16 params),
  this rank's reduced and averaged gradient, one element per shard element.
* **chunk**: rank r's slice of one bucket seen as a unit of optimizer state: its master, its
  ``exp_avg``/``exp_avg_sq`` and (offloaded) its host copy of the gradient live together, on the
  device or in host memory (``offload``/``gpu_margin_mem_ratio``; ``zeroshard/chunk.py``).
* **master shard** (``Chunk.master``): per chunk, a 1-D fp32 copy of the slice for bf16/fp16
  params (and, offloaded to host memory, for any dtype). For fp32/fp64 params on their device
  there is no copy: the slices of the flat param buffer are the master weights.
* **virtual parameter** (``LocalShard.virtual_params``): one 1-D ``nn.Parameter`` per
  (param ∩ slice) piece, a view of the master (or of the flat param buffer for fp32). The wrapped
  optimizer sees only these, so it creates state only for this rank's shard and keeps a ``step``
  per piece, exactly as it would per param (Rajbhandari et al., "ZeRO", SC'20, §5.1; the
  virtual-parameter scheme of the SageMaker model parallel library).
* **flat grad buffer** (stage 1 only, ``GradReducer``): 1-D, param dtype, same layout as the flat
  param buffer; the params' ``.grad`` are views of it, so a bucket is reduce-scattered in place.
* **staging bucket** (stage 2 only, ``GradReducer``): one bucket's gradients in ``reduce_dtype``,
  filled as params become ready and freed once reduce-scattered into the grad shard.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from zeroshard.partition import FlatLayout, build_layout


class FlatParamBuffer:
    """Flat storage for params of one dtype on one device; binds the params as views of it.

    Args:
        params: trainable params, all of one dtype and device, in layout order (the caller
            passes reverse registration order). Their values are copied into the buffer.
        bucket_numel: soft cap on elements per bucket (see :func:`~zeroshard.partition.build_layout`).
        world_size: sharding degree N; every bucket is padded to a multiple of it.
        names: per param, how errors name it (``param_groups[g]['params'][j]``).

    Attributes:
        params: the params, in layout order; ``params[i].data`` is ``param_view(i)``.
        layout: the :class:`~zeroshard.partition.FlatLayout`.
        data: 1-D, the params' dtype and device, ``layout.numel`` elements; padding is zero.

    Raises:
        ValueError: if the params do not share one dtype and device (see ``build_layout`` for
            the size checks).
    """

    def __init__(self, params: Sequence[nn.Parameter], bucket_numel: int, world_size: int, names: Sequence[str] | None = None) -> None:
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(f"a flat buffer needs params of one dtype and device; got {kinds}")
        self.params = list(params)
        self.names = list(names) if names is not None else [f"param {i}" for i in range(len(self.params))]
        self.layout: FlatLayout = build_layout([p.numel() for p in params], bucket_numel, world_size)
        first = self.params[0]
        self.data: Tensor = torch.zeros(self.layout.numel, dtype=first.dtype, device=first.device)
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

    def param_view(self, index: int, of: Tensor | None = None) -> Tensor:
        """1-D view of param ``index`` in ``of`` (default: the flat param buffer).

        ``of`` may be any 1-D tensor with this buffer's layout, such as a flat grad buffer.
        """
        slot = self.layout.slots[index]
        return (self.data if of is None else of)[slot.offset : slot.offset + slot.numel]

    def bucket_view(self, bucket: int, of: Tensor | None = None) -> Tensor:
        """1-D view of bucket ``bucket`` (padding included) in ``of`` (default: the flat param buffer)."""
        b = self.layout.buckets[bucket]
        return (self.data if of is None else of)[b.offset : b.offset + b.padded_numel]

    @torch.no_grad()
    def follow(self, index: int) -> bool:
        """Re-bind param ``index`` as a view of the buffer if its storage was replaced; whether it was.

        ``model.to(...)``, ``.cpu()``, ``.to("cpu:0")`` under torchrun (what HF Trainer and
        accelerate do) and ``param.data = ...`` keep the ``Parameter`` object but give it new
        storage, which the buffer's updates would no longer reach. The param's current values
        win: they are copied into the buffer, and the param becomes its view again.

        Raises:
            RuntimeError: the param now has another device, dtype or shape, which a buffer built
                for the old ones cannot follow; names the param and says what to do.
        """
        param = self.params[index]
        view = self.param_view(index)
        if param.device == view.device and param.data_ptr() == view.data_ptr() and param.dtype == view.dtype and param.numel() == view.numel():
            return False
        if param.device != view.device or param.dtype != view.dtype or param.numel() != view.numel():
            raise RuntimeError(
                f"{self.names[index]} (shape {tuple(param.shape)}) is now {param.dtype} on {param.device}, but the optimizer was built "
                f"for {view.dtype} on {view.device} with {view.numel()} elements: zeroshard cannot follow a change of device, dtype or size. "
                "Move or cast the model first, then build the optimizer (model.to(...); opt = ShardedOptimizer(...))"
            )
        view.copy_(param.detach().reshape(-1))
        param.data = view.view_as(param)
        return True

    def slice_view(self, bucket: int, rank: int) -> Tensor:
        """1-D view of ``rank``'s slice of bucket ``bucket`` in the flat param buffer."""
        start, end = self.layout.buckets[bucket].rank_range(rank, self.layout.world_size)
        return self.data[start:end]
