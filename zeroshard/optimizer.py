"""``ShardedOptimizer``: ZeRO stage 1/2 around any ``torch.optim.Optimizer``. Orchestration only.

See [Note: zeroshard buffers] in ``zeroshard/flat_buffer.py`` for the buffers named here.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from zeroshard import checkpoint, collectives
from zeroshard.flat_buffer import FlatParamBuffer
from zeroshard.grad_reducer import GradReducer
from zeroshard.groups import ShardingGroups, resolve_groups
from zeroshard.local_shard import LocalShard
from zeroshard.memory import MemoryUsage, measure
from zeroshard.validation import check_arguments, check_params

logger = logging.getLogger("zeroshard")

@dataclass
class _ShardedGroup:
    """What zeroshard keeps for one param group of the wrapped optimizer.

    Attributes:
        params: the group's original params, in the user's order (frozen ones included).
        shards: indices into ``ShardedOptimizer._shards``, one per dtype of trainable params.
    """

    params: list[nn.Parameter]
    shards: list[int]


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1/2 data parallelism around an already-built ``torch.optim`` optimizer.

    Each param group's trainable params are copied into one flat buffer per dtype and become
    views of it. The buffer is cut into buckets; each rank owns ``1/N`` of every bucket and hands
    the wrapped optimizer *virtual parameters* covering only that part, so optimizer state (and,
    for bf16/fp16 params, the fp32 master weights) exist for ``1/N`` of the model on each rank.
    Gradients are reduce-scattered bucket by bucket during backward (stage 2 frees the full
    gradients as it goes; stage 1 keeps them) and averaged over the group; after the update the
    slices are all-gathered back into the params. No DDP wrapper is needed: the optimizer does
    the data-parallel gradient reduction itself, and broadcasts rank 0's params at construction.

    Follows Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
    Models", SC'20, §5 (stages 1 and 2), with the virtual-parameter scheme of the SageMaker model
    parallel library; mirrors ``torch.distributed.optim.ZeroRedundancyOptimizer`` in API.

    Memory per rank for Ψ mixed-precision params and sharding degree N (Adam): stage 1
    ``4Ψ + 16Ψ/N`` bytes, stage 2 ``2Ψ + 16Ψ/N`` plus the buckets in flight (the grad shard is
    kept in fp32). N is the shard group's size, not the number of data-parallel ranks.

    Args:
        optimizer: a ``torch.optim.Optimizer`` instance built on the model's params, not yet
            stepped. Its ``param_groups`` stay the live list the user and LR schedulers see, with
            each group's ``"params"`` replaced by this rank's virtual parameters (1-D, fp32 for
            16-bit params, else the param dtype).
        stage: 1 shards optimizer state and master weights; 2 also shards gradients.
        process_group: the data-parallel ranks and how they shard: ``None`` (the world, flat
            sharding), a ``ProcessGroup`` (e.g. a subgroup; ranks outside it run their own), a
            1-D ``DeviceMesh``, or a 2-D ``DeviceMesh`` with dims ("replicate", "shard") for
            hybrid (MiCS) sharding: state sharded within each "shard" group and replicated across
            "replicate" (see :func:`zeroshard.hybrid_mesh`). Gradients are averaged over all
            data-parallel ranks. Every member must build the optimizer on the same params, in the
            same order.
        bucket_size_mb: size of a gradient reduce-scatter / param all-gather bucket in MiB of the
            param dtype (DDP's default, 25). A param larger than this gets a bucket of its own.
        overlap_comm: reduce-scatter each bucket as soon as its gradients are ready during
            backward (``True``) or all buckets at the end of backward (``False``).
        reduce_dtype: dtype of the gradient reduce-scatter; ``None`` reduces in each param's dtype.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer`` (or is already sharded),
            ``process_group`` is neither a ``ProcessGroup`` nor a ``DeviceMesh``, or
            ``reduce_dtype`` is not a floating-point ``torch.dtype``.
        ValueError: ``stage`` not in {1, 2}; ``bucket_size_mb`` not positive; torch.distributed
            not initialized, this rank not in ``process_group``, or a 2-D mesh whose dims are not
            ("replicate", "shard"); no trainable params; params on
            several devices, sparse or complex params; an optimizer that already holds state;
            ranks holding different param shapes (raised on every rank, naming the param).
            All checks but the last run before any collective.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        stage: int = 2,
        process_group: ProcessGroup | DeviceMesh | None = None,
        bucket_size_mb: float = 25.0,
        overlap_comm: bool = True,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        check_arguments(optimizer, stage, bucket_size_mb, reduce_dtype)
        self.optimizer = optimizer
        self.stage = stage
        self.groups: ShardingGroups = resolve_groups(process_group)
        self.process_group = self.groups.shard
        self.world_size = self.groups.shard_size
        self.rank = dist.get_rank(self.process_group)
        self.bucket_size_mb = float(bucket_size_mb)
        self.overlap_comm = overlap_comm
        self.reduce_dtype = reduce_dtype
        self._init_optimizer_hooks()

        self._groups: list[_ShardedGroup] = []
        self._shards: list[LocalShard] = []
        self._param_index: list[list[int]] = []  # per shard, per layout position: torch.optim param index
        self._param_steps: list[int] = []  # per torch.optim param index: updates so far (replicated)
        self._consolidated: dict[str, Any] | None = None  # full state, on the consolidate_state_dict rank
        self._issued: dict[int, weakref.ref] = {}  # id -> DTensor, for those the last state_dict() returned
        self._device: torch.device | None = None
        self._reducer: GradReducer | None = None
        self._shard_groups(range(len(optimizer.param_groups)))
        self._log_layout()

    def _init_optimizer_hooks(self) -> None:
        """Set up what ``torch.optim.Optimizer.__init__`` sets up for hooks, without taking params.

        The wrapped optimizer owns ``param_groups``, ``state`` and ``defaults`` (see the
        properties below); this object adds the step/state-dict hook registries torch's
        ``register_step_pre_hook`` and friends use, and torch's profiling wrapper around ``step``.
        """
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._patch_step_function()

    # -- the wrapped optimizer's live attributes ---------------------------------------------

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's live ``param_groups``; ``"params"`` holds virtual parameters."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        """The wrapped optimizer's state, keyed by virtual parameter (this rank's shard only)."""
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's ``defaults``."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    # -- partitioning ------------------------------------------------------------------------

    def _shard_groups(self, indices: range) -> None:
        """Flatten, broadcast and shard the given param groups of the wrapped optimizer.

        Local checks first; then one fingerprint all-gather over every group (so a mismatch
        raises on all ranks before any size-dependent collective); then the broadcast.
        """
        groups = [list(dict.fromkeys(self.optimizer.param_groups[g]["params"])) for g in indices]
        self._device = check_params([p for params in groups for p in params], indices, self._device, first=not self._shards)
        fingerprint = [
            (f"param_groups[{g}]['params'][{j}]", tuple(p.shape), str(p.dtype), p.requires_grad)
            for g, params in zip(indices, groups)
            for j, p in enumerate(params)
        ]
        for group in self.groups.all():
            collectives.check_same_on_all_ranks("param", fingerprint, group)

        buffers: list[FlatParamBuffer] = []
        records = []
        first_index = len(self._param_steps)  # torch.optim numbers params across groups in order
        for params in groups:
            trainable = [p for p in params if p.requires_grad]
            index_of = {id(p): first_index + j for j, p in enumerate(params)}
            first_index += len(params)
            shard_ids = []
            for dtype in dict.fromkeys(p.dtype for p in trainable):
                # Reverse registration order approximates the order gradients become ready.
                same_dtype = [p for p in reversed(trainable) if p.dtype == dtype]
                shard_ids.append(len(self._shards) + len(buffers))
                buffers.append(FlatParamBuffer(same_dtype, self._bucket_numel(dtype), self.world_size))
                self._param_index.append([index_of[id(p)] for p in same_dtype])
            records.append(_ShardedGroup(params=params, shards=shard_ids))
        self._param_steps.extend([0] * (first_index - len(self._param_steps)))
        frozen = [p.data for params in groups for p in params if not p.requires_grad]
        # Replicas take replica 0's values, then each shard group its first rank's: all equal rank (0, 0).
        for group in reversed(self.groups.all()):
            if dist.get_world_size(group) > 1:
                collectives.broadcast_from_first_([b.data for b in buffers] + frozen, group)

        new_shards = [LocalShard(buffer, self.rank) for buffer in buffers]
        self._shards.extend(new_shards)
        self._groups.extend(records)
        for g, record in zip(indices, records):
            self.optimizer.param_groups[g]["params"] = [v for k in record.shards for v in self._shards[k].virtual_params]
        if self._reducer is None:
            self._reducer = GradReducer(
                new_shards, stage=self.stage, groups=self.groups, reduce_dtype=self.reduce_dtype, overlap_comm=self.overlap_comm
            )
        else:
            for shard in new_shards:
                self._reducer.add_shard(shard)

    def _bucket_numel(self, dtype: torch.dtype) -> int:
        return max(1, int(self.bucket_size_mb * 2**20) // dtype.itemsize)

    def _log_layout(self) -> None:
        if self.rank != 0:
            return
        numel = sum(s.buffer.layout.numel for s in self._shards)
        buckets = sum(len(s.buffer.layout.buckets) for s in self._shards)
        params = sum(len(s.buffer.params) for s in self._shards)
        shard = sum(s.buffer.layout.shard_numel for s in self._shards)
        replicas = self.groups.data_parallel_size // self.world_size
        logger.info(
            "zeroshard: stage %d, sharded over %d ranks x %d replicas: %d params (%d elements with padding) in %d flat buffers, "
            "%d buckets of <= %.1f MiB; each rank holds optimizer state for %d elements",
            self.stage, self.world_size, replicas, params, numel, len(self._shards), buckets, self.bucket_size_mb, shard,
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the wrapped optimizer and shard it (a collective: call on every rank).

        Mirrors ``torch.optim.Optimizer.add_param_group``: the group's defaults come from the
        wrapped optimizer. Existing groups keep their layout and state; the new group gets flat
        buffers, buckets and virtual parameters of its own.

        Raises:
            TypeError, ValueError: as ``torch.optim.Optimizer.add_param_group`` does, and for the
                param checks of the constructor. On error the optimizer is left as it was.
        """
        params = param_group.get("params") if isinstance(param_group, dict) else None
        params = [params] if isinstance(params, Tensor) else list(params or [])
        sharded = {id(p) for record in self._groups for p in record.params}
        again = [tuple(p.shape) for p in params if id(p) in sharded]
        if again:
            raise ValueError(f"param_group holds params already in another param group (shapes {again[:5]}); a param can be in one group only")
        self.optimizer.add_param_group(param_group)
        index = len(self.optimizer.param_groups) - 1
        try:
            self._shard_groups(range(index, index + 1))
        except BaseException:
            self.optimizer.param_groups.pop()
            raise

    # -- training ----------------------------------------------------------------------------

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Context manager: backward passes inside accumulate gradients locally, with no communication.

        Mirrors ``DistributedDataParallel.no_sync``. The first backward outside the block (or
        ``step()``, whichever comes first) reduces everything accumulated, so the result equals
        one large batch.
        """
        return self._reducer.no_sync()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduce what is left, update this rank's shard with the wrapped optimizer, all-gather params.

        Gradients are consumed: the grad shards (and stage 1's flat grad buffer) are zeroed
        afterwards, so only ``model.zero_grad()`` — or nothing at all — needs to be called between
        steps. A param that got no gradient on any rank is skipped, its state untouched, as in
        ``torch.optim``. Collective: call on every rank.

        Args:
            closure: re-evaluates the model and returns the loss (run with grad enabled).

        Returns:
            The closure's loss, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._reducer.reduce_for_step()
            used = self._reducer.global_used()
            if any(any(flags) for flags in used):
                for shard, flags in zip(self._shards, used):
                    shard.refresh_master()
                    shard.attach_grads(flags)
                self.optimizer.step()
                for shard in self._shards:
                    shard.detach_grads()
                    shard.write_back()
                self._all_gather_params()
                for k, flags in enumerate(used):
                    for i, stepped in enumerate(flags):
                        self._param_steps[self._param_index[k][i]] += stepped
            self._reducer.reset()
            self._consolidated = None
        return loss

    def _all_gather_params(self) -> None:
        if self.world_size == 1:
            return
        works = [
            collectives.all_gather(shard.buffer.bucket_view(b.index), shard.buffer.slice_view(b.index, self.rank), self.process_group)
            for shard in self._shards
            for b in shard.buffer.layout.buckets
        ]
        for work in works:
            # The params must hold every rank's update before the next forward reads them.
            work.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients, as ``torch.optim.Optimizer.zero_grad``, and zeroshard's gradient buffers.

        With stage 1 a trainable param's ``.grad`` stays a view of the flat grad buffer, which is
        zeroed, whatever ``set_to_none`` says; that keeps gradient storage contiguous.
        """
        for record in self._groups:
            for p in record.params:
                if p.grad is None or self._reducer.owns_grad(p):
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.zero_()
        self._reducer.reset()

    # -- introspection and state -------------------------------------------------------------

    def memory_usage(self) -> MemoryUsage:
        """Bytes this optimizer owns on this rank: flat params, gradient buffers, shards, optimizer state."""
        state = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
        return measure(
            {
                "params": [s.buffer.data for s in self._shards],
                "grads": self._reducer.grad_buffers(),
                "grad_shard": [s.grad_shard for s in self._shards],
                "master": [s.master for s in self._shards if s.master is not None],
                "optimizer_state": state,
            },
            self._device,
        )

    def _checkpoint_view(self) -> checkpoint.CheckpointView:
        return checkpoint.CheckpointView(
            self.optimizer, self._shards, [g.params for g in self._groups], self._param_index, self._param_steps, self.groups.mesh, self.process_group
        )

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state: this rank's shard, or the full state right after consolidation.

        Runs no collective (HF Trainer and accelerate call it on one rank). The first call on
        the rank that just ran :meth:`consolidate_state_dict` (before any ``step()``) returns the
        full state in plain ``torch.optim`` format; every other call the sharded format: per bucket, 1-D
        ``DTensor`` s of each per-element state (and fp32 master) that
        ``torch.distributed.checkpoint`` reshards onto any world size, with the param groups,
        per-param steps and a layout signature (see ``zeroshard/checkpoint.py``). The tensors are
        copies: loading into them never touches the optimizer until :meth:`load_state_dict`.
        A freshly built optimizer returns zero-filled entries to load into (no dummy step).

        Raises:
            ValueError: the wrapped optimizer keeps scalar state other than ``step``.
        """
        if self._consolidated is not None:
            state_dict, self._consolidated = self._consolidated, None
            return state_dict
        state_dict = checkpoint.sharded_state_dict(self._checkpoint_view())
        self._issued = {id(t): weakref.ref(t) for t in checkpoint.bucket_tensors(state_dict)}
        return state_dict

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full optimizer state onto global rank ``to``, one bucket at a time.

        A collective: call it on every rank. Afterwards :meth:`state_dict` on rank ``to``
        returns the full state in plain ``torch.optim`` format — param-shaped state keyed by the
        wrapped optimizer's param indices, every hyperparameter, and a ``"zeroshard"`` entry (param
        shapes and dtypes, fp32 masters of 16-bit params) that plain torch ignores — once, which loads
        into an unsharded optimizer of the same class, or into a ``ShardedOptimizer`` at any world
        size. Mirrors ``ZeroRedundancyOptimizer.consolidate_state_dict``.

        Raises:
            ValueError: ``to`` is not a rank of the world.
        """
        if not 0 <= to < dist.get_world_size():
            raise ValueError(f"to={to} is not a rank of the world (size {dist.get_world_size()})")
        self._consolidated = checkpoint.consolidate(self._checkpoint_view(), to)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a sharded state dict (this layout, any world size via DCP) or a full one (any world size).

        Accepts what :meth:`state_dict` returns — filled by ``dcp.load`` at any world size, or
        saved with ``torch.save`` at this same world size — and full ``torch.optim``-format dicts:
        from :meth:`consolidate_state_dict` or from an unsharded optimizer of the same class on
        the same params. The checkpoint's hyperparameters win, as in ``torch.optim``. Runs no
        collective. Everything is checked before anything is written, so on error the optimizer
        is as it was.

        Raises:
            ValueError: anything else, or a state dict for another model (group count, param
                count, shape or dtype: the param is named), another optimizer's state, another
                ``bucket_size_mb``, or a sharded dict from another world size not loaded through DCP.
        """
        view = self._checkpoint_view()
        meta = state_dict.get("zeroshard") if isinstance(state_dict, dict) else None
        if isinstance(meta, dict) and meta.get("format") == checkpoint.SHARDED_FORMAT:
            tensors = checkpoint.bucket_tensors(state_dict)
            filled_in_place = bool(tensors) and all(self._issued.get(id(t), lambda: None)() is t for t in tensors)
            inner, steps, masters = checkpoint.load_sharded(view, state_dict, filled_in_place)
        elif isinstance(state_dict, dict) and (meta is None or (isinstance(meta, dict) and meta.get("format") == checkpoint.FULL_FORMAT)):
            inner, steps, masters = checkpoint.load_full(view, state_dict)
        else:
            raise ValueError(f"state_dict is neither a zeroshard state dict nor a torch.optim one (zeroshard entry: {meta!r})")
        self.optimizer.load_state_dict(inner)
        with torch.no_grad():
            for k, offset, values in masters:
                self._shards[k].master[offset : offset + values.numel()].copy_(values)
        self._param_steps[:] = steps
        self._consolidated = None

    def __repr__(self) -> str:
        return f"ShardedOptimizer(stage={self.stage}, world_size={self.world_size}, rank={self.rank}, optimizer={self.optimizer!r})"

