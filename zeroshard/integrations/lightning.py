"""Lightning adapter: :class:`ShardedStrategy` (Trainer) and :class:`ShardedFabricStrategy` (Fabric).

Both are Lightning's own ``DDPStrategy`` with one change: clipping. Lightning clips by calling
``torch.nn.utils.clip_grad_norm_`` on the ``.grad`` of the optimizer's params
(``Trainer(gradient_clip_val=...)`` through the precision plugin, ``fabric.clip_gradients``
through the strategy), which a :class:`~zeroshard.ShardedOptimizer` no longer holds: stage 2
leaves a ``ReducedGrad`` there, which refuses to be clipped, and stage 1 the local, unreduced sum.
Here clipping by norm becomes ``opt.clip_grad_norm_(max_norm)`` (the global norm over every
shard and rank, applied inside the step); clipping by value is refused.

What the rest of ``DDPStrategy`` does needs nothing from this adapter:

* It wraps the model in ``DistributedDataParallel``: the optimizer finds the wrapper, switches
  its gradient reduction off (zeroshard reduces alone; DDP still broadcasts module buffers) and
  follows ``no_sync`` for gradient accumulation (``accumulate_grad_batches``,
  ``fabric.no_backward_sync``). See ``docs/integrations.md``.
* Its checkpoints call ``consolidate_state_dict()`` and save rank 0's ``state_dict()`` (as for
  ``ZeroRedundancyOptimizer``), the plain ``torch.optim`` format, which every rank loads at
  resume, at any world size.

Follows ``lightning.pytorch.strategies.DeepSpeedStrategy`` in spirit: the optimizer's
partitioning stays inside the optimizer, the strategy routes what Lightning does around it.
"""

from __future__ import annotations

from typing import Any

try:
    import lightning.fabric.strategies as fabric_strategies
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision
except ModuleNotFoundError as error:  # an optional adapter: say how to get what it needs
    raise ModuleNotFoundError(f"{__name__} needs lightning: pip install 'zeroshard[integrations]' ({error})") from error
import torch
from torch import nn

from zeroshard.optimizer import ShardedOptimizer

VALUE_CLIP_REFUSED = (
    "clipping by value (gradient_clip_algorithm='value', fabric.clip_gradients(clip_val=...)) is not supported with a "
    "ShardedOptimizer: clip by norm (gradient_clip_val with the default algorithm 'norm', or max_norm=)"
)
GRAD_SCALER_REFUSED = (
    "precision={precision!r} (fp16 AMP with a torch.amp.GradScaler) is not supported by zeroshard's Lightning strategies yet: "
    "Lightning refuses to clip an optimizer that unscales its own gradients, and Lightning runs fp16 AMP on GPUs only, where "
    "this path is untested. Use precision='bf16-mixed' or '32-true' (a plain loop with a GradScaler works: docs/numerics.md)"
)


def _sharded(optimizer: Any) -> ShardedOptimizer | None:
    """The :class:`~zeroshard.ShardedOptimizer` inside Lightning's optimizer wrappers, or ``None``."""
    while not isinstance(optimizer, ShardedOptimizer):
        inner = getattr(optimizer, "_optimizer", None)  # LightningOptimizer and Fabric's _FabricOptimizer
        if inner is None or inner is optimizer:
            return None
        optimizer = inner
    return optimizer


class _ClipsThroughShardedOptimizer:
    """Mixin over a Lightning ``Precision`` plugin: clipping a ``ShardedOptimizer`` by norm calls its ``clip_grad_norm_``."""

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        sharded = _sharded(optimizer)
        if sharded is None:
            super().clip_grad_by_norm(optimizer, clip_val)  # type: ignore[misc]
        else:
            sharded.clip_grad_norm_(float(clip_val))

    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        if _sharded(optimizer) is not None:
            raise ValueError(VALUE_CLIP_REFUSED)
        super().clip_grad_by_value(optimizer, clip_val)  # type: ignore[misc]


_CLIPPING_CLASSES: dict[type, type] = {}


def _clipping_class(precision_class: type) -> type:
    """``precision_class`` with :class:`_ClipsThroughShardedOptimizer` in front (one class per precision class)."""
    if precision_class not in _CLIPPING_CLASSES:
        _CLIPPING_CLASSES[precision_class] = type(f"Sharded{precision_class.__name__}", (_ClipsThroughShardedOptimizer, precision_class), {})
    return _CLIPPING_CLASSES[precision_class]


def _refuse_grad_scaler(precision: Any, optimizers: list[Any], precision_name: str) -> None:
    if getattr(precision, "scaler", None) is not None and any(_sharded(opt) is not None for opt in optimizers):
        raise ValueError(GRAD_SCALER_REFUSED.format(precision=precision_name))


class ShardedStrategy(pl.strategies.DDPStrategy):
    """``lightning.pytorch.strategies.DDPStrategy`` for ``configure_optimizers`` returning a ``ShardedOptimizer``.

    ``Trainer(strategy=ShardedStrategy(), ...)``; the same arguments as ``DDPStrategy``. With
    ``gradient_clip_val`` the coming step is clipped by the global gradient norm
    (:meth:`zeroshard.ShardedOptimizer.clip_grad_norm_`); with other optimizers it behaves
    as ``DDPStrategy``.

    Raises:
        ValueError: at ``fit``, with a ``ShardedOptimizer``: ``gradient_clip_algorithm="value"``,
            or a precision that scales the loss with a ``GradScaler`` (``"16-mixed"``).
    """

    strategy_name = "zeroshard"

    @pl.strategies.DDPStrategy.precision_plugin.setter  # type: ignore[attr-defined]
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        plugin = precision_plugin if precision_plugin is not None else Precision()
        if not isinstance(plugin, _ClipsThroughShardedOptimizer):
            plugin.__class__ = _clipping_class(type(plugin))
        self._precision_plugin = plugin

    def setup(self, trainer: pl.Trainer) -> None:
        """``DDPStrategy.setup``, then refuse what a ``ShardedOptimizer`` cannot honour (see the class's Raises)."""
        super().setup(trainer)
        _refuse_grad_scaler(self.precision_plugin, self.optimizers, str(trainer.precision))
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "value":  # a str enum
            if any(_sharded(opt) is not None for opt in self.optimizers):
                raise ValueError(VALUE_CLIP_REFUSED)


class ShardedFabricStrategy(fabric_strategies.DDPStrategy):
    """``lightning.fabric.strategies.DDPStrategy`` for a ``ShardedOptimizer``: ``fabric.clip_gradients`` honoured.

    ``Fabric(strategy=ShardedFabricStrategy(), ...)``; the same arguments as Fabric's
    ``DDPStrategy``. ``fabric.clip_gradients(model, opt, max_norm=...)`` on a
    ``ShardedOptimizer`` returns the global pre-clip norm (a 0-d fp32 tensor) and clips the
    coming step by it; with other optimizers it behaves as ``DDPStrategy``.

    Raises:
        ValueError: ``fabric.clip_gradients(clip_val=...)`` (by value) on a ``ShardedOptimizer``;
            ``fabric.setup`` of a ``ShardedOptimizer`` under a precision with a ``GradScaler``.
        RuntimeError: ``error_if_nonfinite=True`` (Fabric's default) and a non-finite norm, as
            ``torch.nn.utils.clip_grad_norm_`` raises; not under zeroshard's own dynamic loss
            scaling (fp16 params), where an overflow skips the step and lowers the scale.
    """

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        _refuse_grad_scaler(self.precision, [optimizer], type(self.precision).__name__)
        return super().setup_optimizer(optimizer)

    def clip_gradients_norm(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = True
    ) -> torch.Tensor:
        sharded = _sharded(optimizer)
        if sharded is None:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        norm = sharded.clip_grad_norm_(float(max_norm), norm_type)
        if error_if_nonfinite and not torch.isfinite(norm) and not sharded.loss_scale:  # an fp16 overflow skips the step
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite ({norm.item()}), "
                "so it cannot be clipped; with error_if_nonfinite=False the ShardedOptimizer skips this step instead"
            )
        return norm

    def clip_gradients_value(self, module: nn.Module, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        if _sharded(optimizer) is not None:
            raise ValueError(VALUE_CLIP_REFUSED)
        super().clip_gradients_value(module, optimizer, clip_val)
