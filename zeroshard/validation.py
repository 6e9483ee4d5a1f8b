"""Checks of ``ShardedOptimizer``'s arguments and params, run before any collective: each raises the ``TypeError`` or
``ValueError`` that ``ZeroRedundancyOptimizer`` and ``torch.optim`` raise for the same mistake, naming the argument and values."""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from zeroshard.comm import collectives
from zeroshard.comm.groups import ShardingGroups, resolve_groups
from zeroshard.layout.chunk import is_virtual_param
from zeroshard.layout.flat_buffer import is_sharded, param_name
from zeroshard.reduce.coordinator import scaler_in_use
from zeroshard.step.fused_adam import fused_adam_kind
from zeroshard.step.loss_scaler import DynamicLossScaler
from zeroshard.step.wrapped import is_subclass_state, throwaway_state

# torch.optim classes whose update is element-wise: each element's new value depends only on that
# element's param, gradient and state, and on per-param scalars (the step count, NAdam's
# mu_product, ASGD's eta and mu). They give the same numbers on flat 1-D slices as on whole params.
ELEMENTWISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "ASGD", "Rprop",
))

# torch.optim classes that cannot run on 1-D slices of params, and why.
NOT_ELEMENTWISE = {
    "Adafactor": "its second moment is factored over each param's rows and columns, which a 1-D slice does not have",
    "Muon": "it orthogonalizes each 2-D param's update as a whole (Newton-Schulz)",
}

# Optimizers zeroshard cannot run in either partition mode, and why.
UNSUPPORTED = {
    "LBFGS": "it needs a closure and views of all params as one flat vector for its line search",
    "SparseAdam": "it needs sparse gradients, and zeroshard reduces dense ones",
}


def _is_number(value: Any) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def choose_partition(optimizer: torch.optim.Optimizer, partition: Any, assume_elementwise: Any) -> str:
    """How to shard ``optimizer``'s params: ``"flat"`` (1-D slices) or ``"param"`` (each param whole on one rank).

    ``partition=None`` picks ``"flat"`` for the classes in :data:`ELEMENTWISE` (exactly those classes: a subclass may change
    the update) and for any class with ``assume_elementwise=True``, and ``"param"`` (correct for any per-param update) otherwise.

    Raises:
        TypeError: ``assume_elementwise`` is not a ``bool``.
        ValueError: ``partition`` is not ``None``, ``"flat"`` or ``"param"``; LBFGS or SparseAdam (:data:`UNSUPPORTED`);
            ``partition="flat"`` or ``assume_elementwise=True`` for a class known not to be element-wise
            (:data:`NOT_ELEMENTWISE`); ``assume_elementwise=True`` with ``partition="param"``. Messages name the class.
    """
    if not isinstance(assume_elementwise, bool):
        raise TypeError(f"assume_elementwise={assume_elementwise!r} must be a bool, got {type(assume_elementwise).__name__}")
    if partition is not None and partition not in ("flat", "param"):
        raise ValueError(f"partition={partition!r} must be None, 'flat' or 'param'")
    cls = type(optimizer)
    name = cls.__name__
    known = getattr(torch.optim, name, None) is cls
    if known and name in UNSUPPORTED:
        raise ValueError(f"{name} cannot be sharded: {UNSUPPORTED[name]}. Use DDP for {name}")
    if known and name in NOT_ELEMENTWISE and (partition == "flat" or assume_elementwise):
        given = "partition='flat'" if partition == "flat" else "assume_elementwise=True"
        raise ValueError(f"{name} is not element-wise: {NOT_ELEMENTWISE[name]}. {given} would hand it 1-D slices of params; "
                         "leave partition=None (or pass partition='param') to give each param whole to one rank")
    if assume_elementwise and partition == "param":
        raise ValueError("assume_elementwise=True asks for partition='flat', but partition='param' was given: pass one of them")
    chosen = partition if partition is not None else "flat" if cls in ELEMENTWISE or assume_elementwise else "param"
    if chosen == "flat" and cls not in ELEMENTWISE:
        _refuse_state_not_per_element(optimizer)
    return chosen


def _refuse_state_not_per_element(optimizer: torch.optim.Optimizer) -> None:
    """Raise ``ValueError`` (naming the class and the way out) if ``optimizer``'s class keeps, for a large 1-D param, state that
    is not one floating-point value per element: tensor subclasses (torchao's low-bit moments) or plain tensors of another shape
    or an integer dtype (bitsandbytes' 8-bit codes, ``qmap`` and ``absmax``). One throwaway step on the host; a class that
    fails it is not refused."""
    cls, shape = type(optimizer), (1 << 16,)
    try:
        state = throwaway_state(optimizer, optimizer.param_groups[0], shape, torch.float32, "cpu")
    except Exception:
        return
    kinds = sorted({type(v).__name__ for v in state.values() if is_subclass_state(v)})
    odd = {key: (tuple(v.shape), str(v.dtype)) for key, v in state.items()
           if isinstance(v, Tensor) and v.dim() > 0 and not is_subclass_state(v) and (v.shape != shape or not v.is_floating_point())}
    if kinds or odd:
        kept = ", ".join(kinds) if kinds else f"{odd} (key: shape, dtype) for a param of shape {shape}"
        raise ValueError(f"{cls.__name__} keeps its state as {kept} (quantized in blocks of a param's elements, or not one value "
                         "per element): on the 1-D "
                         "slices of partition='flat' (or assume_elementwise=True) the blocks would depend on the world size, and the flat "
                         "checkpoint formats cannot carry it. Leave partition=None (or pass partition='param') to give each param whole "
                         "to one rank, which trains and checkpoints it as the unsharded optimizer does")


def check_offload(offload: Any) -> None:
    """Raise ``TypeError`` (not a str: ``offload=True``) or ``ValueError`` unless ``offload`` is ``None`` or ``"cpu"``
    (``ShardedOptimizer`` and ``estimate_memory`` alike)."""
    if offload is not None and not isinstance(offload, str):
        raise TypeError(f"offload={offload!r} must be None or the str 'cpu' (DeepSpeed's offload_optimizer device), got {type(offload).__name__}")
    if offload not in (None, "cpu"):
        raise ValueError(f"offload={offload!r} must be None or 'cpu'")


def check_stage_and_bucket_size(stage: Any, bucket_size_mb: Any) -> None:
    """Raise ``TypeError`` (not an int; not a number) or ``ValueError`` unless ``stage`` is 1 or 2 and ``bucket_size_mb`` a finite
    positive number of MiB (``ShardedOptimizer`` and ``estimate_memory`` alike)."""
    if not isinstance(stage, int) or isinstance(stage, bool):
        raise TypeError(f"stage={stage!r} must be the int 1 or 2, got {type(stage).__name__}")
    if stage not in (1, 2):
        raise ValueError(f"stage={stage!r} must be 1 or 2")
    if not _is_number(bucket_size_mb):
        raise TypeError(f"bucket_size_mb={bucket_size_mb!r} must be a number (MiB), got {type(bucket_size_mb).__name__}")
    if not (math.isfinite(bucket_size_mb) and bucket_size_mb > 0):
        raise ValueError(f"bucket_size_mb={bucket_size_mb!r} must be a finite positive number (MiB)")


def check_arguments(optimizer: Any, stage: Any, bucket_size_mb: Any, overlap_comm: Any, reduce_dtype: Any) -> None:
    """Raise ``TypeError`` or ``ValueError`` (``ShardedOptimizer``'s Raises) on an argument ``ShardedOptimizer`` cannot use."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer instance, got {type(optimizer).__name__}: wrap the optimizer you "
                        "build, ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=...)) (ZeroRedundancyOptimizer's params and "
                        "optimizer_class arguments in one)")
    for g, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            if is_virtual_param(p):
                raise TypeError(f"optimizer {type(optimizer).__name__} is already wrapped by a ShardedOptimizer: its {param_name(g, j)} "
                                f"is a virtual parameter (1-D, shape {tuple(p.shape)}) of that one's shard. Wrap each torch optimizer once; for a "
                                "new optimizer, build a new torch optimizer on model.parameters() and wrap that")
    check_stage_and_bucket_size(stage, bucket_size_mb)
    if not isinstance(overlap_comm, bool):
        raise TypeError(f"overlap_comm={overlap_comm!r} must be a bool, got {type(overlap_comm).__name__}")
    if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point):
        raise TypeError(f"reduce_dtype={reduce_dtype!r} must be None or a floating-point torch.dtype")
    if not all("step" in entry and float(entry["step"]) == 0 for entry in optimizer.state.values()):
        raise ValueError(f"optimizer already holds state for {len(optimizer.state)} params; wrap it before its first step and load checkpoints "
                         "through ShardedOptimizer.load_state_dict")


def check_options(optimizer: torch.optim.Optimizer, max_grad_norm: Any, loss_scale: Any, offload: Any, gpu_margin_mem_ratio: Any,
                  collective_timeout_s: Any = None, overlap_param_gather: Any = True, master_weights: Any = True) -> None:
    """Raise ``TypeError`` or ``ValueError`` (``ShardedOptimizer``'s Raises) on a step option ``ShardedOptimizer`` cannot use."""
    for name, value in (("overlap_param_gather", overlap_param_gather), ("master_weights", master_weights)):
        if not isinstance(value, bool):
            raise TypeError(f"{name}={value!r} must be True or False, got {type(value).__name__}")
    check_offload(offload)
    if not master_weights and offload is not None:
        raise ValueError(f"master_weights=False with offload={offload!r}: the offloaded update is torch's fused CPU AdamW on fp32 master "
                         "weights in host memory; keep master_weights=True to offload, or offload=None to step the params themselves")
    if offload is not None and fused_adam_kind(optimizer) is None:
        raise ValueError("offload='cpu' runs torch's fused CPU Adam/AdamW: it needs torch.optim.Adam or AdamW without amsgrad, capturable or "
                         f"differentiable, got {type(optimizer).__name__}")
    if isinstance(gpu_margin_mem_ratio, bool) or not isinstance(gpu_margin_mem_ratio, (int, float)) or not 0.0 <= gpu_margin_mem_ratio <= 1.0:
        raise ValueError(f"gpu_margin_mem_ratio={gpu_margin_mem_ratio!r} must be a number between 0.0 and 1.0")
    if gpu_margin_mem_ratio > 0 and offload is None:
        raise ValueError(f"gpu_margin_mem_ratio={gpu_margin_mem_ratio!r} places offloaded state: it needs offload='cpu' (without offload all state "
                         "is on the device)")
    if max_grad_norm is not None and not _is_number(max_grad_norm):
        raise TypeError(f"max_grad_norm={max_grad_norm!r} must be None or a positive number, got {type(max_grad_norm).__name__}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm={max_grad_norm!r} must be None or a positive number")
    if collective_timeout_s is not None and not _is_number(collective_timeout_s):
        raise TypeError(f"collective_timeout_s={collective_timeout_s!r} must be None or a number of seconds, got {type(collective_timeout_s).__name__}")
    if collective_timeout_s is not None and not (math.isfinite(collective_timeout_s) and collective_timeout_s > 0):
        raise ValueError(f"collective_timeout_s={collective_timeout_s!r} must be None or a finite positive number of seconds")
    if isinstance(loss_scale, bool):
        raise TypeError(f"loss_scale={loss_scale!r} must be None, 'dynamic', a positive number or a DynamicLossScaler, got bool")
    if not (loss_scale is None or loss_scale == "dynamic" or isinstance(loss_scale, DynamicLossScaler)
            or (_is_number(loss_scale) and math.isfinite(loss_scale) and loss_scale > 0)):
        raise ValueError(f"loss_scale={loss_scale!r} must be None, 'dynamic', a finite positive number or a DynamicLossScaler")
    if isinstance(loss_scale, DynamicLossScaler) and scaler_in_use(loss_scale):
        raise ValueError("loss_scale is a DynamicLossScaler that another open ShardedOptimizer already uses: each step() updates its "
                         "scaler, so a shared one would move twice a step. Give each its own DynamicLossScaler with the same settings; "
                         "zeroshard.clip_grad_norm_(optimizers, max_norm) over all of them keeps their scales equal")


def check_construction(optimizer: Any, process_group: Any, *, stage: Any, bucket_size_mb: Any, overlap_comm: Any, reduce_dtype: Any,
                       max_grad_norm: Any, loss_scale: Any, offload: Any, gpu_margin_mem_ratio: Any, partition: Any, assume_elementwise: Any,
                       collective_timeout_s: Any, overlap_param_gather: Any, master_weights: Any) -> tuple[str, ShardingGroups]:
    """``ShardedOptimizer``'s argument checks (its arguments, unchecked): :func:`check_arguments`, :func:`choose_partition` and
    :func:`check_options` on this rank, then (a collective) the options every rank must share over each of ``process_group``'s
    groups. Returns the partition (``"flat"`` or ``"param"``) and the resolved process groups.

    Raises ``TypeError`` or ``ValueError`` from those checks and from :func:`~zeroshard.comm.groups.resolve_groups`; on every
    rank when ranks pass different options."""
    check_arguments(optimizer, stage, bucket_size_mb, overlap_comm, reduce_dtype)
    chosen = choose_partition(optimizer, partition, assume_elementwise)
    check_options(optimizer, max_grad_norm, loss_scale, offload, gpu_margin_mem_ratio, collective_timeout_s, overlap_param_gather, master_weights)
    groups = resolve_groups(process_group, None if collective_timeout_s is None else datetime.timedelta(seconds=collective_timeout_s))
    # The options every rank must share: they decide the layout and the collectives (a difference makes gloo abort the process) or
    # the numbers every rank must compute alike (a difference lets the shards drift apart in silence). gpu_margin_mem_ratio only
    # places this rank's state.
    scale = ("DynamicLossScaler", sorted(vars(loss_scale).items())) if isinstance(loss_scale, DynamicLossScaler) else loss_scale
    options = [
        ("optimizer", f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"), ("stage", stage), ("bucket_size_mb", float(bucket_size_mb)),
        ("overlap_comm", overlap_comm), ("reduce_dtype", str(reduce_dtype)), ("max_grad_norm", max_grad_norm), ("loss_scale", scale),
        ("offload", offload), ("partition", chosen), ("master_weights", master_weights),
    ]
    # Unbounded: ranks may reach construction far apart (rank 0 loading weights).
    groups.check_each(lambda group: collectives.check_same_on_all_ranks("option", options, group), None, "the ShardedOptimizer constructor")
    return chosen, groups


def check_whole_param_steps(optimizer: torch.optim.Optimizer, groups: range, params_of: list[list[nn.Parameter]]) -> None:
    """``partition="param"``: raise, on every rank alike, if the wrapped optimizer refuses a param's shape.

    Each distinct (shape, dtype, param group) gets one step of a throwaway instance of the class on a meta-device param, so
    that what ``step()`` would raise on the param's owner alone (Muon: "Param gradient must be a 2D matrix") is raised on
    every rank, before any collective. Shapes it cannot step on the meta device (Adafactor reads a value) are not checked.

    Raises:
        ValueError: the optimizer raised ``ValueError`` or ``TypeError`` for a param (named, with its shape and message).
    """
    cls = type(optimizer)
    seen = set()
    for g, params in zip(groups, params_of):
        for j, p in enumerate(params):
            if not is_sharded(p) or (tuple(p.shape), p.dtype, g) in seen:
                continue
            seen.add((tuple(p.shape), p.dtype, g))
            try:
                throwaway_state(optimizer, optimizer.param_groups[g], p.shape, p.dtype, "meta")
            except (ValueError, TypeError) as error:
                raise ValueError(f"{cls.__name__} cannot update {param_name(g, j)} (shape {tuple(p.shape)}): {error}") from error
            except (RuntimeError, NotImplementedError, AssertionError):
                continue  # no step on the meta device (Adafactor reads a value; capturable=True asserts CUDA): not checked


def check_params(params_of: list[list[nn.Parameter]], groups: range, device: torch.device | None, first: bool) -> torch.device:
    """Raise on params that cannot be sharded; return the one device they (and ``device``, that of the params sharded so
    far, if any) share. ``params_of`` holds the params of each of the param groups ``groups``; with ``first`` (the optimizer's
    first groups), some param must be trainable.

    Raises:
        ValueError: no trainable param with elements (first groups only), non-leaf params, sparse params, non-floating trainable
            params, trainable params whose elements share memory (a stride of 0), params on several devices, or on the meta
            device (named as ``param_groups[g]['params'][j]``).
    """
    named = [(param_name(g, j), p) for g, params in zip(groups, params_of) for j, p in enumerate(params)]
    params = [p for _, p in named]
    if first and not any(is_sharded(p) for p in params):
        raise ValueError(f"param_groups {list(groups)} hold {len(params)} params, none with requires_grad=True and at least one element: nothing to optimize")
    if bad := [(tuple(p.shape), str(p.layout)) for p in params if p.layout != torch.strided]:
        raise ValueError(f"sparse params are not supported (shape, layout): {bad[:5]}")
    if non_leaf := [(name, tuple(p.shape)) for name, p in named if not p.is_leaf]:
        raise ValueError(f"{non_leaf[0][0]} (shape {non_leaf[0][1]}) is not a leaf tensor (it has a grad_fn; {len(non_leaf)} params are not): "
                         "autograd accumulates no .grad into it. Pass the model's nn.Parameters (model.parameters()), not results of ops on them")
    if bad := [(tuple(p.shape), str(p.dtype)) for p in params if p.requires_grad and not p.dtype.is_floating_point]:
        raise ValueError(f"only real floating-point params can be sharded; got (shape, dtype) {bad[:5]}")
    if overlapping := [(name, tuple(p.shape), p.stride()) for name, p in named
                       if is_sharded(p) and any(st == 0 and n > 1 for st, n in zip(p.stride(), p.shape))]:
        name, shape, stride = overlapping[0]
        raise ValueError(f"{name} (shape {shape}, stride {stride}) has elements that share memory (an expand()ed tensor): torch.optim refuses "
                         "to update it in place, and sharded it would train each element on its own. Make it a param of its own values "
                         "(nn.Parameter(t.clone()), or of the unexpanded shape)")
    devices = {p.device for p in params} | ({device} if device is not None else set())
    if len(devices) > 1:
        raise ValueError(f"all params must be on one device; got params on {sorted(map(str, devices))}")
    if meta := [(name, tuple(p.shape)) for name, p in named if p.is_meta]:
        name, shape = meta[0]
        raise ValueError(f"{name} (shape {shape}) is on the meta device ({len(meta)} params are): it has no values to train. "
                         "Materialize the model first (model.to_empty(device=...) and initialize it), then build the optimizer")
    return devices.pop()


def check_same_order(named: Sequence[tuple[str, Tensor]], group: ProcessGroup, caller: str, timeout: datetime.timedelta | None) -> None:
    """Raise ``ValueError`` on every rank of ``group`` when a rank lists the same params as its rank 0 in another order, as
    a ``set`` of params does: each rank would reduce, update and receive one param as another. The params' fp64 norms are
    compared: a rank whose norms are rank 0's in another order (with the same shapes) raises. Ranks whose values differ (fresh
    init where rank 0 loaded weights: the broadcast makes them equal) are not checked, nor params alike everywhere (LayerNorm
    weights of ones).

    ``named``: the params with their names, in this rank's order, whose shapes every rank already shares.
    """
    if not named or dist.get_world_size(group) == 1:
        return
    with torch.no_grad():  # fp64 norms, sent as their int64 bit patterns; of a frozen complex param its real pairs', of an integer one its values'
        values = [torch.view_as_real(p.detach()) if p.is_complex() else p.detach() if p.is_floating_point() else p.detach().double() for _, p in named]
        norms = torch.stack([torch.linalg.vector_norm(v, dtype=torch.float64) for v in values]).view(torch.int64)
    keys = [tuple(p.shape) for _, p in named]
    what = f"{caller}: the check that every rank lists the params in the same order"
    sent = norms.to(collectives.collective_device(group))
    gathered = [v.cpu().view(torch.float64).tolist() for v in collectives.all_gather_int64(sent, group, timeout, what, f"call {caller}")]
    first = gathered[0]
    for rank, values in enumerate(gathered[1:], start=1):
        if values == first or sorted(zip(keys, values)) != sorted(zip(keys, first)):
            continue  # the same order, or other values (not a reordering)
        j = next(j for j in range(len(values)) if values[j] != first[j])
        k = next(k for k in range(len(first)) if first[k] == values[j] and keys[k] == keys[j])
        raise ValueError(f"{named[j][0]} on rank {dist.get_global_rank(group, rank)} holds the values {named[k][0]} holds on rank "
                         f"{dist.get_global_rank(group, 0)} (shape {keys[j]}): the ranks list the params in different orders (a "
                         "set() of params?), so each would be reduced and updated as another. Build the optimizer from "
                         "model.parameters(), or a list in the same order on every rank")
