"""The global gradient norm, the overflow check and "which params got a gradient", in one all-reduce (docs/numerics.md, "One step").

An inf or NaN anywhere makes the sum of squares non-finite: that is the overflow check (ZeRO's and Megatron's ``found_inf``).
The infinity norm sends a count of non-finite shards in the sum's place and takes its value from a MAX all-reduce: the
overflow check never rests on MAX, which gloo computes with ``std::max`` and so drops a NaN unless rank 0 holds it.
"""

from __future__ import annotations

import datetime
import functools
import math
import numbers
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from zeroshard.comm import collectives
from zeroshard.comm.groups import ShardingGroups
from zeroshard.grad.partial_norm import copy_to_device
from zeroshard.kernels import grad_sumsq
from zeroshard.layout.local_shard import LocalShard

NORM_TYPES = (2.0, math.inf)


@dataclass(frozen=True)
class GradStats:
    """What one step needs to know about the reduced gradients of all ranks."""

    # the global norm (of the norm_type asked for) of the gradients as they sit in the grad shards (still multiplied by the loss
    # scale, if any); inf or NaN on overflow
    norm: float
    used: list[list[bool]]  # per shard, per param: whether the param got a gradient on some rank
    dtype: torch.dtype = torch.float32  # as torch.nn.utils.clip_grad_norm_ returns it: fp64 when any grad shard is fp64, else fp32
    # the norm the clip coefficient and grad_norm take instead of norm (scaled alike): the joint norm of zeroshard.clip_grad_norm_
    # for an optimizer under a torch.amp.GradScaler, whose own norm decides the skip
    clip_norm: float | None = None

    @property
    def pre_clip_norm(self) -> float:
        """The norm the clip coefficient divides by: ``clip_norm``, else ``norm``."""
        return self.norm if self.clip_norm is None else self.clip_norm

    @property
    def found_inf(self) -> bool:
        """Whether any gradient element on any rank is inf or NaN."""
        return not math.isfinite(self.norm)


def reduce_grad_stats(shards: list[LocalShard], local_used: list[list[bool]], groups: ShardingGroups, norm_type: float = 2.0,
                      timeout: datetime.timedelta | None = None, caller: str = "step()", max_norm: float = 0.0,
                      optimizer: torch.optim.Optimizer | None = None) -> ReducedStats:
    """Reduce this rank's sum of squares (or max magnitude) and used-flags (``local_used``: per shard, per param) over every
    data-parallel rank, reading nothing back: :meth:`ReducedStats.read` does (the step's one host sync), or
    :meth:`ReducedStats.norm` keeps the norm on the device. ``caller`` is named in a timeout error.

    ``max_norm``: the coming step's clip (0: none); ``optimizer``: the wrapped optimizer, whose param groups' ``lr`` (a real
    number or a 1-element tensor; anything else, ``None`` included, counts as 0) every rank must share too. On CPU or with
    ``timeout`` (the host waits anyway) each rides along as ``log1p(|x|)`` with its sign, in a slot per data-parallel rank (the
    others' zero, so the sum is exact and every rank reads every rank's values), and :meth:`ReducedStats.check` raises on every
    rank alike where they differ: a clip on some ranks only, or a learning rate set differently on some rank (each would update
    its own shard with its own, where DDP's replicas drift apart).

    Raises:
        ValueError: another ``norm_type``.
        RuntimeError: an all-reduce did not complete within ``timeout``.
    """
    if norm_type not in NORM_TYPES:
        raise ValueError(f"norm_type={norm_type!r} must be 2.0 or inf")
    device = shards[0].grad_shard.device
    # The norm in fp64 for fp64 gradients, as torch.nn.utils.clip_grad_norm_ computes it in their dtype.
    dtype = torch.float64 if any(s.grad_shard.dtype == torch.float64 for s in shards) else torch.float32
    flat_used = [u for used in local_used for u in used]
    # No second host sync per step; in the common step, every param used, not even a copy.
    flags = _all_set(len(flat_used), device, dtype) if all(flat_used) else copy_to_device(flat_used, device, dtype)
    if norm_type == 2.0:
        local = functools.reduce(torch.add, [grad_sumsq(s.grad_shard) for s in shards])  # shards in order, as sum() adds them
    else:
        local = torch.stack([s.grad_shard.abs().max() if s.grad_shard.numel() else torch.zeros((), device=device) for s in shards]).max()
    summed = local if norm_type == 2.0 else (~torch.isfinite(local)).float()  # sum of squares, or a non-finite count
    checked = device.type == "cpu" or timeout is not None
    groups_lrs = [] if optimizer is None or not checked else [
        (f"{type(optimizer).__name__}'s param group {g}", _number(group.get("lr"))) for g, group in enumerate(optimizer.param_groups)]
    checked_values = (("max_norm", max_norm), *groups_lrs) if checked else ()
    extra = []
    if checked:
        slots = torch.zeros(len(checked_values), groups.data_parallel_size, dtype=dtype)  # per value, a slot per data-parallel rank
        slots[:, groups.data_parallel_rank] = torch.tensor([_code(value) for _, value in checked_values], dtype=dtype)
        extra.append(slots.reshape(-1).to(device))
    both = torch.cat([summed.reshape(1).to(dtype), flags, *extra])
    replica_rank = dist.get_rank(groups.replicate) if groups.replicate is not None else 0
    hint = "run the same backward passes and call clip_grad_norm_() and step() alike"
    for group in groups.reducing:
        if group is groups.replicate and norm_type == 2.0 and replica_rank != 0:
            both[0] = 0.0  # the replicas' grad shards are identical: count one of them
        collectives.wait(collectives.all_reduce(both, group), timeout, f"{caller}: the all-reduce of the gradient norm", hint)
    if norm_type != 2.0:
        for group in groups.reducing:
            work = collectives.all_reduce(local, group, op=dist.ReduceOp.MAX)
            collectives.wait(work, timeout, f"{caller}: the all-reduce of the gradient inf-norm", hint)
    return ReducedStats(both, local, local_used, norm_type, dtype, checked_values, groups.data_parallel_size, caller,
                        tuple(groups.data_parallel_ranks) if checked else ())


def _number(value: object) -> float:
    """A learning rate as a float: a number's or a 1-element tensor's value (read where the host waits anyway), else 0 (``None``:
    none kept; another kind of value, ``"auto"``, is the optimizer's own business)."""
    if isinstance(value, numbers.Real) or (isinstance(value, Tensor) and value.numel() == 1):
        return float(value)
    return 0.0


def _code(value: float) -> float:
    """``log1p(|value|)`` with ``value``'s sign: at most ~710, so its square stays finite in fp32 (inf for an infinite value)."""
    return math.copysign(math.log1p(abs(value)), value)


@functools.cache  # never evicted: a step on another stream may still read one
def _all_set(count: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``count`` used-flags, all set, on ``device``: made once (and waited for, so any stream may read it later)."""
    flags = torch.ones(count, device=device, dtype=dtype)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return flags


@dataclass(frozen=True)
class ReducedStats:
    """The all-reduced statistics, still on the device: ``both`` is ``[sum of squares (inf norm: the count of non-finite shards),
    one used-flag per param..., then per :attr:`checked` value one slot per data-parallel rank...]`` in ``dtype``; ``local`` the
    inf norm's all-reduced largest magnitude (0-dim), or this rank's sum of squares."""

    both: Tensor
    local: Tensor
    local_used: list[list[bool]]
    norm_type: float
    dtype: torch.dtype
    # (name, value) of max_norm and of each param group's lr: what every rank must share, each in a slot per data-parallel rank
    # at the end of ``both`` (empty: not sent)
    checked: tuple[tuple[str, float], ...] = ()
    ranks: int = 1  # the data-parallel ranks that summed it
    caller: str = "step()"
    global_ranks: tuple[int, ...] = ()  # the global rank of each slot (where checked): how an error names them

    @property
    def used_everywhere(self) -> bool:
        """Every param got a gradient on this rank, so on some rank: the flags need no reading."""
        return all(all(flags) for flags in self.local_used)

    def norm(self) -> Tensor:
        """The global norm as a 0-dim float64 device tensor (as :meth:`read` takes it: the device's clip coefficient is the
        host's to the bit), inf or NaN on overflow; no host sync."""
        if self.norm_type == 2.0:
            return self.both[0].double().sqrt()
        return torch.where(self.both[0] == 0, self.local.double(), torch.full((), math.nan, dtype=torch.float64, device=self.local.device))

    def read(self) -> GradStats:
        """The statistics on the host: the step's one host-device synchronization."""
        values = self.both.tolist()
        if self.norm_type == 2.0:
            norm = math.sqrt(values[0]) if math.isfinite(values[0]) else values[0]
        else:
            norm = float(self.local) if values[0] == 0 else math.nan
        self.check()
        used, start = [], 1  # values[0]: the norm's
        for per_shard in self.local_used:
            used.append([v > 0 for v in values[start : start + len(per_shard)]])
            start += len(per_shard)
        return GradStats(norm, used, self.dtype)

    def check(self) -> None:
        """Raise ``RuntimeError`` on every rank alike unless every rank sent the same :attr:`checked` values (a clip's ``max_norm``,
        each param group's lr): every rank reads the same slots. Codes within 1e-6 relative pass (fp32 holds ~6e-8): values
        within about 1e-6 relative below 1, a few 1e-6 above. Reads only the slots (where checked, the host waited for them anyway)."""
        if not self.checked:
            return
        codes = self.both[self.both.numel() - self.ranks * len(self.checked) :].view(len(self.checked), self.ranks)
        equal = (codes == codes[:, :1]).all(dim=1).tolist()  # the common case, in three operators whatever the world size
        for index, ((name, value), same) in enumerate(zip(self.checked, equal)):
            row = [] if same else codes[index].tolist()
            if same or all(math.isclose(c, row[0], rel_tol=1e-6, abs_tol=0.0) or (math.isnan(c) and math.isnan(row[0])) for c in row):
                continue
            held: dict[str, list[str]] = {}  # each value sent, with the global ranks that sent it
            for rank, c in zip(self.global_ranks or range(self.ranks), row):
                held.setdefault(f"{math.copysign(math.expm1(abs(c)), c):.7g}", []).append(str(rank))
            values = "; ".join(f"{v} on rank{'s' if len(r) > 1 else ''} {', '.join(r[:8])}{', ...' if len(r) > 8 else ''}" for v, r in held.items())
            if name == "max_norm":
                raise RuntimeError(f"{self.caller}: the ranks clip this step differently (max_norm here {value:g}, 0 for none; {values}): a "
                                   "clip_grad_norm_() on some ranks only pairs its all-reduce with the others' step(). Every rank must run the "
                                   "same backward passes and call clip_grad_norm_() and step() alike")
            raise RuntimeError(f"{self.caller}: the ranks step {name} with different learning rates (lr here {value:g}; {values}): each "
                               "rank would update its own shard of the params with its own lr, where DDP's replicas would drift apart. Set "
                               "the lr alike on every rank: a scheduler fed each rank's own metric (ReduceLROnPlateau on a local loss) "
                               "needs the metric all-reduced first")
