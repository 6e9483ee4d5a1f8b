"""accelerate adapter: :class:`ShardedAccelerator`, an ``accelerate.Accelerator`` that knows ``ShardedOptimizer``.

``Accelerator.clip_grad_norm_`` picks its path by ``distributed_type`` (FSDP, DeepSpeed, XLA) and
otherwise calls ``torch.nn.utils.clip_grad_norm_`` on the params' ``.grad`` — which a
:class:`~zeroshard.ShardedOptimizer` no longer holds (stage 2) or holds unreduced (stage 1). And
``Accelerator.save_state`` writes ``optimizer.state_dict()`` from the main process only, which for
a ``ShardedOptimizer`` is that rank's shard. :class:`ShardedAccelerator` routes both: clipping
the params of a prepared ``ShardedOptimizer`` becomes ``opt.clip_grad_norm_(max_norm)`` (the
global norm over every shard and rank), and ``save_state`` first gathers the full optimizer state
onto rank 0 (``consolidate_state_dict``), so ``optimizer.bin`` holds the plain ``torch.optim``
format that ``load_state`` loads on every rank, at any world size. Everything else is
``accelerate.Accelerator``'s own.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

try:
    import accelerate
except ModuleNotFoundError as error:  # an optional adapter: say how to get what it needs
    raise ModuleNotFoundError(f"{__name__} needs accelerate: pip install 'zeroshard[integrations]' ({error})") from error
import torch
from torch import nn

from zeroshard.optimizer import ShardedOptimizer


def _unwrap(optimizer: Any) -> Any:
    """The optimizer inside accelerate's ``AcceleratedOptimizer`` wrappers."""
    while isinstance(optimizer, accelerate.optimizer.AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def sharded_optimizers(optimizers: Iterable[Any]) -> list[ShardedOptimizer]:
    """The :class:`~zeroshard.ShardedOptimizer` s among ``optimizers`` (accelerate's wrappers removed)."""
    return [opt for opt in map(_unwrap, optimizers) if isinstance(opt, ShardedOptimizer)]


def clip_sharded_grad_norm_(
    optimizers: Iterable[Any], parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0
) -> torch.Tensor | None:
    """Clip ``parameters`` through the ``ShardedOptimizer`` that owns them; ``None`` when none owns any.

    The trainable params among ``parameters`` must be exactly the trainable params of one
    ``ShardedOptimizer`` in ``optimizers`` (as ``model.parameters()`` is for an optimizer built on
    the whole model): its :meth:`~zeroshard.ShardedOptimizer.clip_grad_norm_` then clips them by
    their global norm and returns it.

    Raises:
        ValueError: the trainable params are split between a ``ShardedOptimizer`` and other
            params, span several ``ShardedOptimizer`` s, or are a part of one optimizer's params
            only: a global norm over them cannot be computed from the shards.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    trainable = {id(p) for p in parameters if p.requires_grad}
    owners = []
    for opt in sharded_optimizers(optimizers):
        owned = {id(p) for params in opt._shard_set.group_params for p in params if p.requires_grad}
        if owned & trainable:
            owners.append((opt, owned))
    if not owners:
        return None
    if len(owners) > 1 or owners[0][1] != trainable:
        outside = len(trainable - set().union(*(owned for _, owned in owners)))
        missing = len(owners[0][1] - trainable)
        raise ValueError(
            f"clip_grad_norm_ was given {len(trainable)} trainable params that are not the trainable params of one ShardedOptimizer "
            f"({len(owners)} ShardedOptimizers own some of them, {outside} belong to none, {missing} of the first one's are missing): "
            "clip the params of each ShardedOptimizer as a whole (model.parameters() for one built on the whole model), or call "
            "opt.clip_grad_norm_(max_norm) yourself"
        )
    return owners[0][0].clip_grad_norm_(max_norm, norm_type)


def check_one_writer(save_on_each_node: bool, world_size: int) -> None:
    """Refuse ``save_on_each_node`` across nodes: the optimizer state is consolidated on rank 0 only.

    Raises:
        ValueError: ``save_on_each_node`` and more ranks than on this node (``LOCAL_WORLD_SIZE``).
    """
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if save_on_each_node and world_size > local_world_size:
        raise ValueError(
            f"save_on_each_node=True on {world_size // local_world_size} nodes: the optimizer state of a ShardedOptimizer is "
            "gathered onto rank 0 only, whose file the other nodes would lack; set save_on_each_node=False"
        )


class ShardedAccelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` for models trained with a :class:`~zeroshard.ShardedOptimizer`.

    Takes ``Accelerator``'s arguments (on a CPU-only machine pass ``cpu=True`` under ``torchrun``,
    else it stays non-distributed). ``prepare(model, opt, dataloader)``, ``accumulate``,
    ``backward`` and ``load_state`` are ``Accelerator``'s own: the DDP wrapper ``prepare`` puts
    around the model is found by the optimizer, whose gradient reduction it switches off (see
    ``docs/design.md``), and ``accumulate``'s ``no_sync`` is followed. Two methods change:

    * :meth:`clip_grad_norm_` clips a ``ShardedOptimizer``'s params by their global norm.
    * :meth:`save_state` gathers each ``ShardedOptimizer``'s full state onto rank 0 first.
    * :meth:`get_state_dict` (which ``save_state`` and ``save_model`` use) copies the params out of
      the optimizer's flat buffers, which accelerate's safetensors writer would take for aliases.
    """

    def clip_grad_norm_(self, parameters: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """``Accelerator.clip_grad_norm_``; params of a prepared ``ShardedOptimizer`` are clipped by it (a collective).

        Raises:
            ValueError: as :func:`clip_sharded_grad_norm_`.
        """
        parameters = list(parameters)
        if self.scaler is not None:  # fp16: hand each ShardedOptimizer the GradScaler's scale first, as accelerate unscales before clipping
            for opt in sharded_optimizers(self._optimizers):
                if opt._shard_set.amp.inv_scale is None:  # not unscaled yet in this step
                    self.scaler.unscale_(opt)
        norm = clip_sharded_grad_norm_(self._optimizers, parameters, max_norm, norm_type)
        return super().clip_grad_norm_(parameters, max_norm, norm_type) if norm is None else norm

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """``Accelerator.get_state_dict``, with params that share a ``ShardedOptimizer``'s flat buffer copied out.

        The params of a ``ShardedOptimizer`` are views of one flat buffer per param group and dtype,
        which accelerate's safetensors writer (``save_state`` and ``save_model``) takes for aliases of
        one tensor and drops but one of them. Each distinct view is copied into its own tensor (tied
        params stay one tensor under both names), at the cost of one copy of those params while saving.
        """
        state_dict = super().get_state_dict(model, unwrap)
        flat = {shard.buffer.data.untyped_storage().data_ptr() for opt in sharded_optimizers(self._optimizers) for shard in opt._shards}
        copies: dict[tuple[int, torch.Size, tuple[int, ...]], torch.Tensor] = {}
        for name, tensor in state_dict.items():
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() in flat:
                key = (tensor.data_ptr(), tensor.shape, tensor.stride())
                if key not in copies:
                    copies[key] = tensor.detach().clone()
                state_dict[name] = copies[key]
        return state_dict

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs: Any) -> str:
        """``Accelerator.save_state``, with each prepared ``ShardedOptimizer``'s state consolidated on rank 0 first.

        A collective, as ``Accelerator.save_state`` is: call it on every rank. The optimizer file
        holds the full ``torch.optim``-format state, which ``load_state`` loads at any world size.

        Raises:
            ValueError: ``save_on_each_node`` with several nodes (each node's main process would
                write its own shard; save on the main process only).
        """
        sharded = sharded_optimizers(self._optimizers)
        if sharded:
            check_one_writer(self.project_configuration.save_on_each_node, self.num_processes)
        for opt in sharded:
            opt.consolidate_state_dict(to=0)
        return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
