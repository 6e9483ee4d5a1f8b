"""``ShardSet``: this rank's local shards of the wrapped optimizer's param groups, as they grow, and how they are made.

A ``ShardedOptimizer`` shards its param groups at construction, a group added later with
``add_param_group``, and params frozen at construction once they become trainable (gradual
unfreezing): :meth:`ShardSet._shard` checks, compares across ranks, flattens and broadcasts
them. ``ShardSet`` keeps that bookkeeping, and the per-param step counts, out of the
optimizer's orchestration. Each :class:`~zeroshard.layout.local_shard.LocalShard` records its param
group and its params' ``torch.optim`` indices itself, so there are no parallel lists.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from zeroshard.comm import collectives
from zeroshard.comm.groups import ShardingGroups
from zeroshard.compat import DisableTorchFunction
from zeroshard.grad.amp import GradScalerLink
from zeroshard.layout.flat_buffer import FlatParamBuffer, is_sharded, param_name
from zeroshard.layout.local_shard import LocalShard
from zeroshard.layout.ownership import assign_owners, param_costs
from zeroshard.reduce.coordinator import take_over
from zeroshard.validation import check_params, check_same_order, check_whole_param_steps

logger = logging.getLogger("zeroshard")


class ShardSet:
    """This rank's :class:`~zeroshard.layout.local_shard.LocalShard` s of every sharded param group (arguments: ``ShardedOptimizer``'s;
    ``host_master``: CPU offload).

    Attributes:
        shards: in the order they were built: each param group's (one per dtype of its
            trainable params), then those of groups added later and of params unfrozen later.
        group_params: per param group, its original params in the user's order (frozen ones
            included): the params ``torch.optim`` numbers, across groups in order.
        param_steps: per ``torch.optim`` param index, the updates so far (the same on every rank:
            a param is stepped when it got a gradient on some rank).
        device: the params' device (``None`` before the first group).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, groups: ShardingGroups, bucket_size_mb: float, host_master: bool,
                 partition: str = "flat", master_weights: bool = True) -> None:
        self.optimizer = optimizer
        self.master_weights = master_weights
        self.partition = partition
        self.groups = groups
        self.bucket_size_mb = bucket_size_mb
        self.host_master = host_master
        self.shards: list[LocalShard] = []
        self.group_params: list[list[nn.Parameter]] = []
        self.param_steps: list[int] = []
        self.device: torch.device | None = None
        self.amp = GradScalerLink()  # what a torch.amp.GradScaler hands the virtual params' gradients
        # add_unfrozen's view of the groups: the sharded params' ids and, per group, its params outside every flat buffer
        # (frozen or empty when sharded), for (shards, groups) of these counts
        self._outside_for = (-1, -1)
        self._sharded_ids: frozenset[int] = frozenset()
        self._outside: list[list[nn.Parameter]] = []
        self._group_ids: list[list[int]] = []  # ids of param_groups[g]["params"] as sharding left them (this rank's virtual params)

    def add_groups(self, indices: range, caller: str = "the ShardedOptimizer constructor", bounded: bool = False) -> list[LocalShard]:
        """Shard the optimizer's param groups ``indices`` (a collective, in ``caller``; ``bounded``: by ``collective_timeout_s``);
        returns the new shards.

        Raises:
            ValueError: a param listed twice in one group; see :meth:`_shard`.
        """
        params_of = [list(dict.fromkeys(self.optimizer.param_groups[g]["params"])) for g in indices]
        for g, params in zip(indices, params_of):
            if len(params) < len(listed := self.optimizer.param_groups[g]["params"]):
                j = next(j for j, p in enumerate(listed) if any(p is q for q in listed[:j]))
                raise ValueError(f"{param_name(g, j)} (shape {tuple(listed[j].shape)}) is listed earlier in its param group too (a tied weight "
                                 "from named_parameters(remove_duplicate=False)?): torch.optim warns and steps it twice per step; list each "
                                 "param once (model.parameters() does)")
        new = self._shard(indices, params_of, len(self.param_steps), caller, self.groups.timeout if bounded else None)
        self.group_params.extend(params_of)
        self.param_steps.extend([0] * sum(map(len, params_of)))
        self._warn_if_some_rank_owns_nothing()
        return new

    def _warn_if_some_rank_owns_nothing(self) -> None:
        """Log (rank 0 of the shard group) a warning when some rank holds no piece of any param (``partition="param"``
        with fewer params than ranks): ``torch.nn.utils.clip_grad_norm_`` over the optimizer's ``param_groups``
        returns at once there, without the collective the other ranks then wait in."""
        size = self.groups.shard_size
        owning = {r for shard in self.shards for r in (shard.buffer.layout.owners or range(size))}  # flat: every rank has slices
        idle = sorted(set(range(size)) - owning)
        if idle and dist.get_rank(self.groups.shard) == 0:
            logger.warning("zeroshard: ranks %s of the %d-rank shard group own no param of this optimizer (%d params, partition=%r): "
                           "torch.nn.utils.clip_grad_norm_ over its param_groups (Lightning's gradient_clip_val, Fabric's "
                           "clip_gradients) would leave the other ranks waiting; clip model.parameters() or use zeroshard.clip_grad_norm_",
                           idle, size, sum(len(s.buffer.params) for s in self.shards), self.partition)

    def add_param_group(self, param_group: dict[str, Any]) -> list[LocalShard]:
        """Add ``param_group`` to the optimizer and shard it (``ShardedOptimizer.add_param_group``); the new shards.

        Raises:
            ValueError: a param already in another group; as ``torch.optim.Optimizer.add_param_group`` and
                :meth:`add_groups` raise, with the optimizer's param groups as they were. Raised on some ranks
                only, every rank raises (:meth:`ShardingGroups.agree`).
        """
        error: Exception | None = None
        try:
            params = param_group.get("params") if isinstance(param_group, dict) else None
            params = [params] if isinstance(params, Tensor) else list(params or [])
            sharded = {id(p) for group in self.group_params for p in group}
            again = [tuple(p.shape) for p in params if id(p) in sharded]
            if again:
                raise ValueError(f"param_group holds params already in another param group (shapes {again[:5]}); a param can be in one group only "
                                 "(one frozen in its group's list joins it once unfrozen)")
            self.check_param_groups()
            self.optimizer.add_param_group(param_group)
        except (TypeError, ValueError) as raised:
            error = raised
        try:
            # Raised on some ranks only, it would leave the others waiting in the checks' collectives: all raise.
            self.groups.agree(error, self.groups.timeout, "add_param_group()", found="refused the param group")
            index = len(self.optimizer.param_groups) - 1
            return self.add_groups(range(index, index + 1), "add_param_group()", bounded=True)
        except BaseException:
            if error is None:  # torch's add_param_group appended it
                self.optimizer.param_groups.pop()
            raise

    def zero_grad(self, set_to_none: bool) -> None:
        """``torch.optim.Optimizer.zero_grad`` over the groups' original params (frozen ones included)."""
        if set_to_none:
            # ``.grad`` is metadata: no torch-function mode needs to see it (the param guard would take a Python call per get and set)
            with DisableTorchFunction():
                for params in self.group_params:
                    for p in params:
                        p.grad = None
            return
        for params in self.group_params:
            for p in params:
                if p.grad is not None:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()

    def check_param_groups(self) -> None:
        """Raise ``ValueError`` (before any collective) if the optimizer's ``param_groups`` gained a group, or a group's
        ``"params"`` list changed, other than through :meth:`add_param_group`: ``torch.optim`` would train params added by hand
        (``param_groups.append(group)``, ``group["params"].extend(params)``), which nothing here shards or reduces, so the
        wrapped optimizer would skip them or step each rank's own gradient; groups reordered (``param_groups.reverse()``) would
        be stepped with each other's hyperparameters. One ``id`` per virtual param and step."""
        groups, sharded = self.optimizer.param_groups, self._group_ids
        if len(groups) != len(sharded):
            raise ValueError(f"optimizer.param_groups has {len(groups)} groups, the ShardedOptimizer sharded {len(sharded)} (in its constructor "
                             "or add_param_group): a group appended to param_groups by hand is neither sharded nor reduced; "
                             "add it with opt.add_param_group(group)")
        for g, (group, ids) in enumerate(zip(groups, sharded)):
            now = list(map(id, group["params"]))
            if now == ids:
                continue
            known = {i for other in sharded for i in other}
            where = f"param_groups[{g}]['params'] has {len(now)} entries where zeroshard put {len(ids)} (this rank's shards of the group's params)"
            if any(i not in known for i in now):
                raise ValueError(f"{where}, some of them others: params added to a group's list, or an entry replaced, by hand are neither "
                                 "sharded nor reduced; add params with opt.add_param_group({'params': [...], ...})")
            raise ValueError(f"{where}, in another order or group: param_groups reordered, or params moved or removed by hand, would be "
                             "stepped with another group's hyperparameters or not at all; change hyperparameters in place, freeze with "
                             "requires_grad_(False)")

    def unfrozen(self) -> list[tuple[int, str]]:
        """``(torch.optim index, name)`` of each param trainable now that is in no flat buffer: frozen when its group was
        sharded and unfrozen since (the next :meth:`add_unfrozen` shards it)."""
        self._note_outside()
        found, start = [], 0
        for g, params in enumerate(self.group_params):
            trainable = {id(p) for p in self._outside[g] if is_sharded(p)}
            found += [(start + j, param_name(g, j)) for j, p in enumerate(params) if id(p) in trainable]
            start += len(params)
        return found

    def _note_outside(self) -> None:
        """Recompute the params outside every flat buffer, if shards or groups were added since."""
        if self._outside_for != (len(self.shards), len(self.group_params)):
            self._sharded_ids = frozenset(id(p) for shard in self.shards for p in shard.buffer.params)
            self._outside = [[p for p in params if id(p) not in self._sharded_ids] for params in self.group_params]
            self._outside_for = (len(self.shards), len(self.group_params))

    def add_unfrozen(self) -> list[LocalShard]:
        """Shard the params that were frozen when their group was sharded and are trainable now.

        Gradual unfreezing: ``torch.optim`` trains a param once it has a gradient. Each group with
        such params gets flat buffers of its own for them, appended to it (a collective; every rank
        must unfreeze the same params: one that unfroze alone waits in the cross-rank check until
        ``collective_timeout_s``, or the process group's timeout). Returns the new shards (none: no
        collective ran); their gradients are still local, for the caller to reduce.
        """
        self._note_outside()
        added: list[LocalShard] = []
        first_param_index = 0
        for g, params in enumerate(self.group_params):
            if any(is_sharded(p) for p in self._outside[g]):
                self.check_param_groups()  # before its length is taken anew
                # Not agreed: a rank that unfroze alone would pair that all-reduce with the others' next collective (a gradient-norm
                # all-reduce or reduce-scatter) of another size (gloo aborts the process); the fingerprint's all-gather times out instead.
                new = self._shard(range(g, g + 1), [params], first_param_index,
                                  "backward(), clip_grad_norm_() or step() after params were unfrozen (alike on every rank)",
                                  self.groups.timeout, already_sharded=self._sharded_ids, agree=False)
                added.extend(new)
                if dist.get_rank(self.groups.shard) == 0:
                    logger.info("zeroshard: param group %d: %d params trainable since the optimizer was built are now sharded",
                                g, sum(len(s.buffer.params) for s in new))
            first_param_index += len(params)
        return added

    def _shard(self, indices: range, params_of: list[list[nn.Parameter]], first_param_index: int, caller: str, timeout: datetime.timedelta | None,
               already_sharded: frozenset[int] = frozenset(), agree: bool = True) -> list[LocalShard]:
        """Flatten, broadcast and shard param groups ``indices`` (``params_of``: their params, frozen ones included;
        ``first_param_index``: the ``torch.optim`` index of the first; ``timeout``: how long its collectives may wait, ``None``: the
        process group's); append the new shards to :attr:`shards` and return them.

        Local checks (agreed by every rank with ``agree``), then per group of ranks the fingerprint and order checks before any
        size-dependent collective, the broadcast from rank 0, and each group's ``"params"`` replaced by (``already_sharded``:
        the ids of params left out, as already in flat buffers; then appended to) this rank's virtual parameters.
        """
        optimizer, groups, partition = self.optimizer, self.groups, self.partition
        # Bounded by collective_timeout_s after construction (add_param_group, unfreezing): a rank that skipped it is named. The
        # constructor waits: ranks may reach it far apart (rank 0 loading weights the broadcast hands the others).
        error: ValueError | None = None
        try:
            device = check_params(params_of, indices, self.device, first=not self.shards)
            if partition == "param":
                check_whole_param_steps(optimizer, indices, params_of)
        except ValueError as raised:
            error = raised
        # A param refused on some ranks only (a non-leaf param, params on several devices, on one rank) would leave the others
        # waiting in the checks' collectives below, unbounded in the constructor: every rank raises.
        if agree:
            groups.agree(error, timeout, caller, found="refused a param")
        elif error is not None:
            raise error
        self.device = device
        taken = [(p, param_name(g, j)) for g, params in zip(indices, params_of) for j, p in enumerate(params)
                 if is_sharded(p) and id(p) not in already_sharded]
        take_over([p for p, _ in taken], [name for _, name in taken])
        fingerprint = [
            entry
            for g, params in zip(indices, params_of)
            for entry in [(f"param_groups[{g}][{key!r}]", value) for key, value in group_settings(optimizer.param_groups[g]).items()]
            + [(param_name(g, j), tuple(p.shape), str(p.dtype), "trainable" if p.requires_grad else "frozen") for j, p in enumerate(params)]
        ]
        broadcast_frozen = [(param_name(g, j), p) for g, params in zip(indices, params_of) for j, p in enumerate(params) if not is_sharded(p)]
        # The broadcast below goes by position: frozen params too. The order check needs the shapes the fingerprint compared.
        named = [(name, p) for p, name in taken] + (broadcast_frozen if not already_sharded else [])

        def check(group: ProcessGroup) -> None:
            collectives.check_same_on_all_ranks("param_groups item", fingerprint, group, timeout=timeout, caller=caller)
            check_same_order(named, group, caller, timeout)

        groups.check_each(check, timeout, caller)

        buffers: list[tuple[FlatParamBuffer, int, list[int]]] = []  # (buffer, its param group, its params' torch.optim indices)
        index = first_param_index
        for g, params in zip(indices, params_of):
            trainable = [p for p in params if is_sharded(p) and id(p) not in already_sharded]
            index_of = {id(p): index + j for j, p in enumerate(params)}
            name_of = {id(p): param_name(g, j) for j, p in enumerate(params)}
            index += len(params)
            for dtype in dict.fromkeys(p.dtype for p in trainable):
                # Reverse registration order approximates the order gradients become ready.
                same_dtype = [p for p in reversed(trainable) if p.dtype == dtype]
                owners = assign_owners(param_costs(optimizer, optimizer.param_groups[g], same_dtype), groups.shard_size) if partition == "param" else None
                buffer = FlatParamBuffer(same_dtype, bucket_numel(self.bucket_size_mb, dtype), groups.shard_size, [name_of[id(p)] for p in same_dtype], owners)
                buffers.append((buffer, g, [index_of[id(p)] for p in same_dtype]))
        frozen = [p.data for params in params_of for p in params if not is_sharded(p)] if not already_sharded else []
        # Replicas take replica 0's values, then each shard group its first rank's: all equal rank (0, 0).
        for group in reversed(groups.all()):
            if dist.get_world_size(group) > 1:
                collectives.broadcast_from_first_([b.data for b, _, _ in buffers] + frozen, group, timeout, caller)

        rank = dist.get_rank(groups.shard)
        shards = [LocalShard(buffer, rank, self.host_master, group=g, param_indices=indices_of, master_weights=self.master_weights)
                  for buffer, g, indices_of in buffers]
        for g in indices:
            virtual = [v for shard in shards if shard.group == g for v in shard.virtual_params]
            optimizer.param_groups[g]["params"] = (optimizer.param_groups[g]["params"] if already_sharded else []) + virtual
        for g in indices:  # these groups only (a hand edit of another stays for check_param_groups to see); a new one is appended
            self._group_ids[g : g + 1] = [list(map(id, optimizer.param_groups[g]["params"]))]
        shard_initial_state(optimizer, shards)
        for shard in shards:
            shard.amp_link = self.amp  # handed to its VirtualGrads (bind_virtual_grads)
        self.shards.extend(shards)
        return shards

    def count_steps(self, used: list[list[bool]], by: int = 1) -> list[list[int]]:
        """Count a step for every param used on some rank; per shard, per param, its new step (0: not stepped).

        ``used[k][i]``: param ``i`` (layout order) of ``shards[k]`` got a gradient on some rank.
        ``by=-1`` takes back a step the device skipped (:class:`~zeroshard.step.pending_skip.PendingSkip`).
        """
        for shard, flags in zip(self.shards, used):
            for index, stepped in zip(shard.param_indices, flags):
                self.param_steps[index] += by * stepped
        return [[self.param_steps[index] if flag else 0 for index, flag in zip(shard.param_indices, flags)]
                for shard, flags in zip(self.shards, used)]

    def layout_summary(self, stage: int) -> str:
        """One log line: the stage, the sharding, params, elements, flat buffers, buckets, and this rank's share."""
        numel = sum(s.buffer.layout.numel for s in self.shards)
        buckets = sum(len(s.buffer.layout.buckets) for s in self.shards)
        params = sum(len(s.buffer.params) for s in self.shards)
        shard = sum(s.buffer.layout.shard_numel for s in self.shards)
        replicas = self.groups.data_parallel_size // self.groups.shard_size
        return (
            f"zeroshard: stage {stage}, partition {self.partition!r}, sharded over {self.groups.shard_size} ranks x {replicas} replicas: {params} params "
            f"({numel} elements with padding) in {len(self.shards)} flat buffers, {buckets} buckets of <= {self.bucket_size_mb:.1f} MiB; "
            f"each rank holds optimizer state for {shard} elements"
        )


def bucket_numel(bucket_size_mb: float, dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in ``bucket_size_mb`` MiB (at least 1)."""
    return max(1, int(bucket_size_mb * 2**20) // dtype.itemsize)


def group_settings(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's settings but its params (``lr``, ``betas``, ``weight_decay``, ...), comparable across ranks: each rank
    updates its shard with its own, so ranks built with different ones would update one model with several."""
    def comparable(value: Any) -> Any:
        if isinstance(value, Tensor) and value.numel() == 1:  # a tensor lr
            return float(value)
        if isinstance(value, (list, tuple)):
            return tuple(comparable(v) for v in value)
        return value if isinstance(value, (int, float, str, bool, type(None))) else type(value).__name__

    return {key: comparable(value) for key, value in sorted(group.items()) if key != "params"}


@torch.no_grad()
def shard_initial_state(optimizer: torch.optim.Optimizer, shards: list[LocalShard]) -> None:
    """Move the state ``optimizer`` created at construction for the params of ``shards`` onto their virtual params.

    ``torch.optim.Adagrad`` creates its ``sum`` (``initial_accumulator_value``) and ``step`` in
    ``__init__``, keyed by the original params, and reads them at its first step. Each virtual
    param gets its piece of every param-shaped state tensor and a copy of every other entry
    (``step``); the original params' entries are dropped. A frozen param keeps its entry until it
    is unfrozen and sharded (see ``ShardedOptimizer._shard_unfrozen``).
    """
    if not optimizer.state:
        return
    for shard in shards:
        for piece, vparam in zip(shard.pieces, shard.virtual_params):
            param = shard.buffer.params[piece.param]
            state = optimizer.state.get(param)
            if state:
                optimizer.state[vparam] = {
                    key: value.reshape(-1)[piece.param_offset : piece.param_offset + piece.numel].clone().view(vparam.shape)
                    if torch.is_tensor(value) and value.shape == param.shape and value.dim() > 0
                    else (value.clone() if torch.is_tensor(value) else value)
                    for key, value in state.items()
                }
    for shard in shards:
        for param in shard.buffer.params:
            optimizer.state.pop(param, None)
