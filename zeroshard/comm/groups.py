"""Which ranks shard together and which replicate: flat sharding, subgroups and hybrid meshes, after MiCS (Zhang et al.,
"MiCS: Near-linear Scaling for Training Gigantic Model on Public Cloud", VLDB 2022, §3) and SageMaker's
``sharded_data_parallel_degree`` (docs/hybrid.md: the grid of groups and the collectives each runs)."""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from zeroshard.comm import collectives

HYBRID_DIMS = ("replicate", "shard")


@dataclass(frozen=True)
class ShardingGroups:
    """The process groups one rank takes part in."""

    shard: ProcessGroup  # the ranks that split the optimizer state among them (size N, the sharding degree)
    replicate: ProcessGroup | None  # the ranks holding the same shard in other replicas; None: flat sharding
    mesh: DeviceMesh  # over the same ranks, 1-D (shard) or 2-D (replicate, shard): where checkpoint DTensors live
    timeout: datetime.timedelta | None = None  # collective_timeout_s: the bound on add_param_group's and an unfreeze's checks

    # A group's size never changes: read once (``dist.get_world_size`` measured 0.3 ms a call under NCCL, torch 2.11, H100).
    @functools.cached_property
    def shard_size(self) -> int:
        """N: ranks sharing one copy of the optimizer state."""
        return dist.get_world_size(self.shard)

    @functools.cached_property
    def data_parallel_size(self) -> int:
        """Ranks whose gradients are averaged: shard size times the number of replicas."""
        return self.shard_size * (dist.get_world_size(self.replicate) if self.replicate is not None else 1)

    @functools.cached_property
    def data_parallel_ranks(self) -> list[int]:
        """The global rank of each of the :attr:`data_parallel_size` ranks: the mesh's ranks, flattened (replica by replica)."""
        return [int(r) for r in self.mesh.mesh.flatten().tolist()]

    @functools.cached_property
    def data_parallel_rank(self) -> int:
        """This rank's place in :attr:`data_parallel_ranks`."""
        return self.data_parallel_ranks.index(dist.get_rank())

    def all(self) -> list[ProcessGroup]:
        """The groups in the order collectives span them: shard first, then replicate."""
        return [self.shard] + ([self.replicate] if self.replicate is not None else [])

    def check_each(self, check: Callable[[ProcessGroup], None], timeout: datetime.timedelta | None, caller: str) -> None:
        """Run ``check``, a cross-rank comparison that raises ``ValueError`` alike on every rank of the group it is given, on
        each group of :meth:`all`, in ``caller`` (what the user called). With a replicate group the ranks then :meth:`agree`:
        a mismatch found within one shard group raises on every rank, not there alone while the others' ranks wait in the
        next collective for ranks that left. Another exception (a timeout's ``RuntimeError``) leaves at once: the process
        group is unusable then.

        Raises:
            ValueError: this rank's check's error, or, on a rank whose checks passed, :meth:`agree`'s.
            RuntimeError: past ``timeout``, some rank did not join.
        """
        error: ValueError | None = None
        for group in self.all():
            try:
                check(group)
            except ValueError as raised:
                error = error or raised
        if self.replicate is not None:
            self.agree(error, timeout, caller)
        if error is not None:
            raise error

    def agree(self, error: Exception | None, timeout: datetime.timedelta | None, caller: str, found: str = "found ranks that differ") -> None:
        """Raise on every rank if any rank has an ``error`` (found by a check of its own, before ``caller``'s collectives): that
        error where there is one, else a ``ValueError`` naming the lowest rank with one and what it ``found``. One all-reduce per group of :meth:`all`
        ((replica i, shard j) reaches every (i, j'), then every (i', j')); none at world size 1.

        Raises:
            ValueError, TypeError: as said above.
            RuntimeError: past ``timeout``, some rank did not join.
        """
        world = dist.get_world_size()  # sent: world - the lowest rank with an error (0: none)
        if world == 1:  # no other rank to tell: no collective
            if error is not None:
                raise error
            return
        failed = torch.tensor([world - dist.get_rank() if error is not None else 0], device=collectives.collective_device(self.shard))
        for group in self.all():
            work = collectives.all_reduce(failed, group, op=dist.ReduceOp.MAX)
            collectives.wait(work, timeout, f"{caller}: the all-reduce of whether any rank's checks failed", f"call {caller}")
        if error is not None:
            raise error
        if lowest := int(failed.item()):
            raise ValueError(f"{caller}: rank {world - lowest} {found} (its error says more); every rank stops here")

    @functools.cached_property
    def reducing(self) -> tuple[ProcessGroup, ...]:
        """The groups of :meth:`all` with more than one rank: those a reduction over every data-parallel rank runs on."""
        return tuple(group for group in self.all() if dist.get_world_size(group) > 1)


def hybrid_mesh(shard_size: int, device_type: str | None = None) -> DeviceMesh:
    """A 2-D ``DeviceMesh`` ("replicate", "shard") over the whole world, for ``process_group=``.

    Consecutive ranks shard together (ranks ``[0, shard_size)`` form the first shard group), so with one node per shard group
    the all-gather and reduce-scatter stay inside a node.

    Args:
        shard_size: ranks per shard group; must divide the world size. ``world_size`` gives flat sharding, 1 plain
            replication (DDP with a local optimizer).
        device_type: the mesh's device type; default ``"cuda"`` when the default process group runs NCCL, else ``"cpu"``
            (gloo on a machine with GPUs keeps its tensors on the CPU).

    Raises:
        ValueError: torch.distributed is not initialized, or ``shard_size`` does not divide the world size (raised before
            any collective; the message lists the valid sizes).
    """
    if not dist.is_initialized():
        raise ValueError("hybrid_mesh: torch.distributed is not initialized; call torch.distributed.init_process_group() first")
    world = dist.get_world_size()
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1 or world % shard_size:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(f"shard_size={shard_size!r} must divide the world size {world}: one of {divisors}")
    device_type = device_type or collectives.collective_device(None).type
    return init_device_mesh(device_type, (world // shard_size, shard_size), mesh_dim_names=HYBRID_DIMS)


def resolve_groups(process_group: ProcessGroup | DeviceMesh | None, timeout: datetime.timedelta | None = None) -> ShardingGroups:
    """The :class:`ShardingGroups` for a ``process_group`` argument of ``ShardedOptimizer``.

    Args:
        process_group: ``None`` (the world), a ``ProcessGroup`` (e.g. a subgroup; ranks outside it run their own), a 1-D
            ``DeviceMesh``, or a 2-D ``DeviceMesh`` with dims ("replicate", "shard") as :func:`hybrid_mesh` builds.
        timeout: ``collective_timeout_s``, kept in the result.

    Raises:
        ValueError: torch.distributed not initialized; a mesh with other dims; this rank not in the group.
        TypeError: anything else.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("process_group: torch.distributed is not initialized; call torch.distributed.init_process_group() first (torchrun sets up "
                         "its environment)")
    replicate, mesh = None, None
    if isinstance(process_group, int) and process_group == dist.GroupMember.NON_GROUP_MEMBER:  # what dist.new_group returns on a rank it leaves out
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of process_group (dist.new_group returned "
                         "GroupMember.NON_GROUP_MEMBER on it): build the optimizer on the ranks of the group only, or pass a group "
                         "this rank is in")
    if process_group is None:
        shard = cast(ProcessGroup, dist.group.WORLD)  # not None: initialized above
    elif isinstance(process_group, ProcessGroup):
        shard = process_group
    elif isinstance(process_group, DeviceMesh):
        names, mesh = process_group.mesh_dim_names, process_group
        if process_group.ndim == 1:
            shard = process_group.get_group()
        elif process_group.ndim == 2 and names is not None and tuple(names) == HYBRID_DIMS:
            shard, replicate = process_group.get_group("shard"), process_group.get_group("replicate")
        else:
            raise ValueError(f"process_group is a {process_group.ndim}-D DeviceMesh with dims {names}; use a 1-D mesh or a 2-D mesh with dims "
                             f"{HYBRID_DIMS} (zeroshard.hybrid_mesh builds one)")
    else:
        raise TypeError(f"process_group must be a ProcessGroup, a DeviceMesh or None, got {type(process_group).__name__}")
    if dist.get_rank(shard) < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of process_group")
    if mesh is None:  # no collective: the mesh wraps the existing group
        mesh = DeviceMesh.from_group(shard, collectives.collective_device(shard).type)
    return ShardingGroups(shard, replicate, mesh, timeout)
