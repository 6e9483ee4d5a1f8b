"""``MemoryUsage``: the bytes a :class:`~zeroshard.ShardedOptimizer` owns, by kind and place; ``estimate_memory``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from zeroshard.layout.chunk import chunks_of
from zeroshard.layout.local_shard import LocalShard
from zeroshard.layout.ownership import assign_owners, default_cost
from zeroshard.layout.partition import build_layout, param_align
from zeroshard.shard_set import bucket_numel
from zeroshard.step.wrapped import is_subclass_state
from zeroshard.validation import check_offload, check_stage_and_bucket_size


@dataclass(frozen=True)
class MemoryUsage:
    """Bytes owned by the optimizer on this rank.

    Attributes:
        device_bytes: bytes on the params' device (on a CPU-only run, that device is the CPU).
        host_bytes: bytes in host memory when the params live on an accelerator (e.g. the
            wrapped optimizer's CPU ``step`` counters); 0 on a CPU-only run.
        by_kind: bytes per kind wherever they live: ``"params"`` (flat param buffers), ``"grads"`` (stage 1 flat grad
            buffers, stage 2 staging buckets in flight), ``"grad_shard"`` (with offload, its host copy too),
            ``"master"`` (fp32 copies for 16-bit params, or every master weight with offload) and ``"optimizer_state"``
            (the wrapped optimizer's state, e.g. ``exp_avg``, ``exp_avg_sq``, ``step``).
    """

    device_bytes: int
    host_bytes: int
    by_kind: dict[str, int] = field(default_factory=dict)


def owned_memory(shards: list[LocalShard], grad_buffers: list[Tensor], optimizer: torch.optim.Optimizer, device: torch.device) -> MemoryUsage:
    """What a ``ShardedOptimizer`` owns on this rank (``ShardedOptimizer.memory_usage``), by kind and place: the shards'
    flat param buffers, grad shards and chunks (master, moments, host buffers), the reducer's ``grad_buffers``, and the
    wrapped optimizer's own state except views of the chunks' moments (counted once); each tensor's ``numel * element_size``
    bytes (a view at its own size), on ``device`` or elsewhere."""
    owned: dict[str, list[Tensor]] = {"params": [s.buffer.data for s in shards], "grads": list(grad_buffers),
                                      "grad_shard": [s.grad_shard for s in shards], "master": [], "optimizer_state": []}
    chunk_storages: set[int] = set()
    for chunk in chunks_of(shards):
        for kind, tensors in chunk.owned_tensors().items():
            owned[kind] += tensors
            chunk_storages.update(t.untyped_storage().data_ptr() for t in tensors)
    owned["optimizer_state"] += [t for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor) for t in _plain_tensors(v)
                                 if t.untyped_storage().data_ptr() not in chunk_storages]
    by_kind = {kind: sum(t.numel() * t.element_size() for t in tensors) for kind, tensors in owned.items()}
    elsewhere = sum(t.numel() * t.element_size() for tensors in owned.values() for t in tensors if t.device != device)
    return MemoryUsage(sum(by_kind.values()) - elsewhere, elsewhere, by_kind)


def _plain_tensors(value: Tensor) -> list[Tensor]:
    """The plain tensors that hold ``value``'s data: itself, or a tensor subclass's inner tensors (torchao's codes, scales, qmap)."""
    if not is_subclass_state(value):
        return [value]
    names, _ = value.__tensor_flatten__()  # type: ignore[attr-defined]
    return [t for name in names for t in _plain_tensors(getattr(value, name))]


# torchao's low-bit Adam classes: (bits per element, default block size, quantization-map entries) of each moment
LOW_BIT = {"8bit": (8, 256, 256), "4bit": (4, 128, 16), "Fp8": (8, 256, 0)}
TORCHAO_MIN_QUANTIZED = 4096  # torchao (like bitsandbytes) quantizes state of params with at least this many elements


def _low_bit_kind(optimizer_class: str) -> str | None:
    """``"8bit"``, ``"4bit"`` or ``"Fp8"`` for torchao's low-bit Adam/AdamW class names, else ``None``."""
    return next((kind for kind in LOW_BIT if optimizer_class in (f"Adam{kind}", f"AdamW{kind}")), None)


def whole_param_state_bytes(optimizer_class: str, numel: int, state_itemsize: int, block_size: int | None = None) -> int:
    """Bytes of ``exp_avg`` and ``exp_avg_sq`` that ``optimizer_class`` keeps for one whole param of ``numel`` elements.

    torchao's low-bit classes (``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8`` and their Adam twins) keep each moment as a
    tensor subclass of ``bits`` per element, an fp32 scale per block of ``block_size`` (default 256, 128 for 4-bit) and
    an fp32 quantization map (256 entries for 8-bit, 16 for 4-bit, none for fp8), for params of at least 4096 elements
    that the block size divides; other params, and ``"AdamW"``/``"Adam"``/``"_AdamW"``, keep plain moments of
    ``state_itemsize`` bytes per element (torchao's ``_AdamBase._new_buffer``). ``step`` aside.
    """
    kind = _low_bit_kind(optimizer_class)
    if kind is None:
        return 2 * state_itemsize * numel
    bits, default_block, qmap = LOW_BIT[kind]
    block = block_size or default_block
    if numel < TORCHAO_MIN_QUANTIZED or numel % block:
        return 2 * state_itemsize * numel
    return 2 * (numel * bits // 8 + 4 * (numel // block) + 4 * qmap)


def estimate_memory(model_or_numel: nn.Module | int, *, stage: int = 2, world_size: int, dtype: torch.dtype | None = None, offload: str | None = None,
                    shard_size: int | None = None, bucket_size_mb: float = 25.0, device_type: str = "cuda", master_weights: bool = True,
                    optimizer_class: str = "AdamW", block_size: int | None = None) -> MemoryUsage:
    """Per-rank bytes a ``ShardedOptimizer`` around an Adam/AdamW owns between steps.

    Predicts what :meth:`ShardedOptimizer.memory_usage` reports after the first ``step()``, kind by kind, for the same
    model and options, without building anything (no process group, no allocation). With Ψ trainable elements, param
    dtype of ``b`` bytes, sharding degree N and fp32 master/state (Rajbhandari et al., "ZeRO", SC'20, §5):

    * ``params``: the flat param buffers, ``b·Ψ_pad`` (all ranks hold the full params); with offload on CUDA, bf16/fp16
      params add a pinned staging copy of the shard in the param dtype (``b·Ψ_pad/N``).
    * ``grads``: stage 1 keeps a flat grad buffer, ``b·Ψ_pad``; stage 2 none between steps (its up to 3 staging buckets of
      ``bucket_size_mb`` each, in ``reduce_dtype``, are freed by the end of ``step()``: not included).
    * ``grad_shard``: ``4·Ψ_pad/N`` (fp32; fp64 params: 8); with offload twice that (its host copy).
    * ``master``: ``4·Ψ_pad/N`` for bf16/fp16 params; fp32 params have none (the flat buffer is the master) unless
      offloaded, when every dtype keeps a host master.
    * ``optimizer_state``: ``exp_avg`` and ``exp_avg_sq``, ``8·Ψ_pad/N``, plus a 4-byte ``step`` tensor per
      (param ∩ rank slice) piece, counted for the rank with the most pieces.

    With ``master_weights=False`` 16-bit params keep no master, the grad shard and moments take the param dtype (``b``
    bytes), and the wrapped optimizer's own step runs (no fused update, also for fp32 params): its state covers its pieces,
    not the padding. torchao's classes run with ``partition="param"``: each param is owned whole by one rank
    (:func:`~zeroshard.layout.ownership.assign_owners`, as for one param group per dtype; an optimizer on several param
    groups assigns each group alone and may place them otherwise), so the state is that of the params a rank owns
    (:func:`whole_param_state_bytes`: 8-bit moments cost about 2 bytes per element, 4-bit about 1), given for the rank that
    owns the most (summed over the dtypes of a mixed model, each dtype's such rank: then an upper bound).

    Ψ_pad is Ψ with padding: params are laid out in reverse registration order, one flat buffer per dtype, in buckets of
    at most ``bucket_size_mb`` MiB of the param dtype (a larger param gets its own), each param starting on a 64-byte
    boundary and each bucket padded to a multiple of N, so Ψ_pad - Ψ is below 64 bytes per param, N elements and 64 bytes per bucket
    (``zeroshard/layout/partition.py``). This is exactly the optimizer's layout
    when built on ``model.parameters()`` in one param group; each more group adds its own buckets' padding. An ``int``
    counts as one param of that many elements.

    Args:
        model_or_numel: the model (its trainable params, tied ones once), or Ψ.
        stage: 1 or 2.
        world_size: the number of data-parallel ranks.
        dtype: the param dtype; ``None``: each param's own (fp32 for an ``int``).
        offload: ``None`` or ``"cpu"`` (master, moments and a gradient copy in host memory).
        shard_size: N for hybrid sharding (``zeroshard.hybrid_mesh(shard_size)``); ``None``: N is ``world_size``.
            Replicas hold the same bytes as one shard group's ranks.
        bucket_size_mb, master_weights: as the optimizer's.
        device_type: the params' device type. ``"cpu"``: everything is ``device_bytes`` and no pinned staging exists, as
            ``memory_usage()`` reports in a CPU-only run; otherwise the offloaded kinds and the ``step`` tensors (torch
            keeps them on the host) are ``host_bytes``.
        optimizer_class: the wrapped class's name: ``"AdamW"`` or ``"Adam"`` (``torch.optim``; ``amsgrad=True``, not modelled,
            adds a third moment, 4 bytes per shard element), or torchao's
            ``"AdamW8bit"``, ``"AdamW4bit"``, ``"AdamWFp8"``, ``"Adam8bit"``, ``"Adam4bit"``, ``"AdamFp8"``, ``"_AdamW"``.
        block_size: a torchao low-bit class's ``block_size``; ``None``: its default.

    Returns:
        A :class:`MemoryUsage` in bytes, ``by_kind`` with the kinds above.

    Raises:
        TypeError: ``stage`` not an int, ``bucket_size_mb`` not a number, ``master_weights`` not a ``bool``, ``dtype`` not a
            ``torch.dtype``.
        ValueError: ``stage`` not 1 or 2, ``world_size`` not an int >= 1, ``shard_size`` not dividing it, ``bucket_size_mb``
            not finite and positive, ``device_type`` not ``"cuda"``/``"cpu"``, ``offload`` not ``None``/``"cpu"`` (or
            ``"cpu"`` with ``master_weights=False`` or a torchao class), a ``model_or_numel`` neither a model nor an int >= 1
            or a model without trainable params, a non-floating ``dtype``, an ``optimizer_class`` outside those above, or
            a ``block_size`` below 1 or given for a class without blocks.
    """
    whole = optimizer_class == "_AdamW" or _low_bit_kind(optimizer_class) is not None
    check_stage_and_bucket_size(stage, bucket_size_mb)  # as the ShardedOptimizer checks them
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1")
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type={device_type!r} must be 'cuda' or 'cpu'")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype={dtype!r} must be a torch.dtype (torch.bfloat16), got {type(dtype).__name__}")
    shards = world_size if shard_size is None else shard_size
    if not isinstance(shards, int) or shards < 1 or world_size % shards:
        raise ValueError(f"shard_size={shard_size!r} must be an int >= 1 that divides world_size={world_size}")
    check_offload(offload)
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} must be a floating-point dtype")
    if optimizer_class not in ("AdamW", "Adam") and not whole:
        raise ValueError(f"optimizer_class={optimizer_class!r} must be 'AdamW', 'Adam', or one of torchao's 'AdamW8bit', 'AdamW4bit', "
                         "'AdamWFp8', 'Adam8bit', 'Adam4bit', 'AdamFp8', '_AdamW'")
    if not isinstance(master_weights, bool):
        raise TypeError(f"master_weights={master_weights!r} must be True or False")
    if offload and whole:
        raise ValueError(f"offload={offload!r} runs torch's fused AdamW: not with optimizer_class={optimizer_class!r}")
    if offload and not master_weights:
        raise ValueError(f"offload={offload!r} runs torch's fused AdamW on fp32 masters: not with master_weights=False")
    if block_size is not None and (not isinstance(block_size, int) or block_size < 1 or _low_bit_kind(optimizer_class) is None):
        raise ValueError(f"block_size={block_size!r} must be None, or an int >= 1 for a torchao low-bit class (optimizer_class="
                         f"{optimizer_class!r})")
    if isinstance(model_or_numel, nn.Module):
        trainable = [p for p in model_or_numel.parameters() if p.requires_grad and p.numel() > 0]
        if not trainable:
            raise ValueError("the model has no trainable params")
        sized = [(tuple(p.shape), dtype or p.dtype) for p in reversed(trainable)]
    else:
        if not isinstance(model_or_numel, int) or isinstance(model_or_numel, bool) or model_or_numel < 1:
            raise ValueError(f"model_or_numel={model_or_numel!r} must be a model or an int >= 1 (a param count)")
        sized = [((int(model_or_numel),), dtype or torch.float32)]
    on_cuda = device_type != "cpu"
    kinds = dict.fromkeys(("params", "grads", "grad_shard", "master", "optimizer_state"), 0)
    host = 0
    for param_dtype in dict.fromkeys(d for _, d in sized):
        shapes = [shape for shape, d in sized if d == param_dtype]
        numels = [math.prod(shape) for shape in shapes]
        item = param_dtype.itemsize
        master_item = max(4, item) if master_weights else item
        owners = assign_owners([default_cost(shape, param_dtype) for shape in shapes], shards) if whole else None  # as param_costs
        layout = build_layout(numels, bucket_numel(bucket_size_mb, param_dtype), shards, owners, param_align(item))
        shard = layout.shard_numel
        pieces = [layout.pieces(rank) for rank in range(shards)]
        if whole:  # per rank: the wrapped optimizer's own state for the params it owns, and a step each
            per_rank = [sum(whole_param_state_bytes(optimizer_class, numels[p.param], master_item, block_size) + 4 for p in ranked)
                        for ranked in pieces]
        elif master_weights:  # the fused update: both moments over each chunk, padding included
            per_rank = [2 * master_item * shard + 4 * len(ranked) for ranked in pieces]
        else:  # torch.optim's own step: moments shaped as each piece
            per_rank = [sum(2 * master_item * p.numel + 4 for p in ranked) for ranked in pieces]
        most = max(range(shards), key=lambda rank: (per_rank[rank], len(pieces[rank])))  # the rank that keeps the most
        state, steps = per_rank[most], 4 * len(pieces[most])
        master = master_item * shard if offload or (item < 4 and master_weights) else 0
        staging = item * shard if offload and on_cuda and item < 4 else 0
        kinds["params"] += item * layout.numel + staging
        kinds["grads"] += item * layout.numel if stage == 1 else 0
        kinds["grad_shard"] += master_item * shard * (2 if offload else 1)
        kinds["master"] += master
        kinds["optimizer_state"] += state
        if on_cuda:
            host += steps + (master + 2 * master_item * shard + master_item * shard + staging if offload else 0)
    return MemoryUsage(sum(kinds.values()) - host, host, kinds)
