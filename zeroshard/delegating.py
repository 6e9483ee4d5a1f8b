"""``DelegatingOptimizer``: a ``torch.optim.Optimizer`` whose params, state and defaults are another optimizer's."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from zeroshard.compat import OPTIMIZER_HOOK_DICTS


class DelegatingOptimizer(torch.optim.Optimizer):
    """An optimizer that owns no params: ``param_groups``, ``state`` and ``defaults`` are ``optimizer``'s live objects, which LR
    schedulers, ``register_step_pre_hook`` and code reading ``opt.param_groups`` / ``opt.state`` see (as with
    ``torch.distributed.optim.ZeroRedundancyOptimizer``'s ``optim``; ``ShardedOptimizer`` is one).

    Sets up what ``torch.optim.Optimizer.__init__`` sets up for hooks (the step and state-dict hook registries that
    ``register_step_pre_hook`` and friends use, and torch's profiling wrapper around ``step``) without taking params.

    Args:
        optimizer: the wrapped ``torch.optim.Optimizer`` (``self.optimizer``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:  # not torch's __init__, which takes params
        self.optimizer = optimizer
        for name in OPTIMIZER_HOOK_DICTS:
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's live ``param_groups`` (a ``ShardedOptimizer``'s hold virtual parameters)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        """The wrapped optimizer's state (a ``ShardedOptimizer``'s: keyed by virtual parameter, this rank's shard only)."""
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's ``defaults``."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value
