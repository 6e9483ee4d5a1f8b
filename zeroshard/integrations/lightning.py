"""Lightning: its finetuning callbacks for a ``ShardedOptimizer`` (docs/integrations.md, "Lightning")::

    from zeroshard.integrations.lightning import BackboneFinetuning, BaseFinetuning  # instead of lightning.pytorch.callbacks'

Lightning's ``BaseFinetuning`` reads ``optimizer.param_groups`` as the model's params: it names them through
``pl_module.named_parameters()`` to record the groups it adds (a ``KeyError`` on a ``ShardedOptimizer``, whose groups hold
virtual params), compares them by value to skip params already trained, and on resume assigns ``optimizer.param_groups``.
These subclasses do the same through the optimizer's own params per group, and otherwise are Lightning's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

try:
    from lightning.pytorch.callbacks import BackboneFinetuning as _BackboneFinetuning
    from lightning.pytorch.callbacks import BaseFinetuning as _BaseFinetuning
    from lightning.pytorch.utilities import rank_zero_warn
except ModuleNotFoundError as error:  # an optional adapter: say how to get what it needs
    raise ModuleNotFoundError(f"{__name__} needs lightning: pip install 'zeroshard[integrations]' ({error})") from error

from zeroshard.optimizer import ShardedOptimizer

__all__ = ["BackboneFinetuning", "BaseFinetuning"]


def _model_param_groups(optimizer: ShardedOptimizer) -> list[dict[str, Any]]:
    """``optimizer.param_groups`` with each group's ``"params"`` the model's params it was given (frozen ones included)."""
    params_of = optimizer.checkpoint_view().group_params
    return [{**{k: v for k, v in group.items() if k != "params"}, "params": params} for group, params in zip(optimizer.param_groups, params_of)]


class BaseFinetuning(_BaseFinetuning):
    """Lightning's ``BaseFinetuning`` (override ``freeze_before_training`` and ``finetune_function`` as there), working on a
    ``ShardedOptimizer``'s model params where Lightning's works on ``optimizer.param_groups``; any other optimizer gets
    Lightning's own code. On resume, the groups ``finetune_function`` had added are added again (``add_param_group``, which
    shards them) with their params trainable, as Lightning-AI/pytorch-lightning#21902 restores them (Lightning 2.6 leaves
    them frozen: #21901), before Lightning loads the optimizer state.

    Raises:
        KeyError: on resume, naming a param of the checkpoint's groups that the module does not have (another model).
    """

    @staticmethod
    def filter_on_optimizer(optimizer: torch.optim.Optimizer, params: Iterable) -> list:
        """``params`` not in any of ``optimizer``'s groups: by identity for a ``ShardedOptimizer`` (Lightning compares values,
        which a virtual param holding equal values would match, on some ranks only), else Lightning's own; warns as Lightning's
        does when it skips some."""
        if not isinstance(optimizer, ShardedOptimizer):
            return _BaseFinetuning.filter_on_optimizer(optimizer, params)
        held = {id(p) for group in _model_param_groups(optimizer) for p in group["params"]}
        params = list(params)
        if any(id(p) in held for p in params):
            rank_zero_warn("The provided params to be frozen already exist within another group of this optimizer. Those parameters will be "
                           "skipped.\nHINT: Did you init your optimizer in `configure_optimizer` as such:\n ShardedOptimizer(torch.optim.AdamW("
                           "filter(lambda p: p.requires_grad, self.parameters()), ...))")
        return [p for p in params if id(p) not in held]

    @staticmethod
    def unfreeze_and_add_param_group(modules: Any, optimizer: torch.optim.Optimizer, lr: float | None = None, initial_denom_lr: float = 10.0,
                                     train_bn: bool = True) -> None:
        """Lightning's, with :meth:`filter_on_optimizer` (Lightning's calls its own by class name)."""
        if not isinstance(optimizer, ShardedOptimizer):
            _BaseFinetuning.unfreeze_and_add_param_group(modules, optimizer, lr, initial_denom_lr, train_bn)
            return
        _BaseFinetuning.make_trainable(modules)
        group_lr = optimizer.param_groups[0]["lr"] / initial_denom_lr if lr is None else float(lr)
        params = BaseFinetuning.filter_on_optimizer(optimizer, _BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True))
        if params:
            optimizer.add_param_group({"params": params, "lr": group_lr})

    def _store(self, pl_module: Any, opt_idx: int, num_param_groups: int, current_param_groups: list[dict[str, Any]]) -> None:
        optimizer = pl_module.trainer.optimizers[opt_idx]
        if isinstance(optimizer, ShardedOptimizer):
            current_param_groups = _model_param_groups(optimizer)
        super()._store(pl_module, opt_idx, num_param_groups, current_param_groups)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        metadata = self._internal_optimizer_metadata
        held = {i: metadata.pop(i) for i, opt in enumerate(trainer.optimizers) if isinstance(opt, ShardedOptimizer) and i in metadata}
        if self._restarting:
            named = dict(pl_module.named_parameters())
            for i, saved in held.items():
                optimizer = trainer.optimizers[i]
                for group in saved[len(optimizer.param_groups) :]:
                    params = [named[name] for name in group["params"]]
                    for param in params:
                        param.requires_grad_(True)
                    optimizer.add_param_group({**group, "params": params})
        try:
            super().on_fit_start(trainer, pl_module)  # Lightning's restore of any other optimizer; ends the restart
        finally:
            metadata.update(held)


class BackboneFinetuning(BaseFinetuning, _BackboneFinetuning):
    """Lightning's ``BackboneFinetuning`` (the same arguments), with :class:`BaseFinetuning`'s ``ShardedOptimizer`` support."""
