"""accelerate: a plain ``Accelerator`` trains a ``ShardedOptimizer``; :func:`save_state_pre_hook` makes ``save_state``'s files
whole (docs/integrations.md, "accelerate": what ``prepare``, ``accumulate`` and ``clip_grad_norm_`` do, and why ``save_state``
needs the hook)::

    accelerator.register_save_state_pre_hook(save_state_pre_hook(opt))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    import accelerate  # noqa: F401  (the framework this adapter is for: name the extra when it is missing)
except ModuleNotFoundError as error:  # an optional adapter: say how to get what it needs
    raise ModuleNotFoundError(f"{__name__} needs accelerate: pip install 'zeroshard[integrations]' ({error})") from error
import torch
from torch import nn

from zeroshard.optimizer import ShardedOptimizer


def save_state_pre_hook(*optimizers: ShardedOptimizer) -> Callable[[list[nn.Module], list[dict[str, Any]], str], None]:
    """A hook for ``accelerator.register_save_state_pre_hook`` that makes ``save_state`` write ``optimizers`` whole.

    The hook (``hook(models, weights, output_dir)``, run by ``save_state`` on every process) gathers each optimizer's full
    state onto rank 0 (a collective: ``save_state`` is one already; its file is written from the main process only) and, in
    ``weights`` (the model state dicts about to be saved), replaces each param that is a view of a ``ShardedOptimizer``'s flat
    buffer by a copy (its safetensors writer keeps one of several tensors sharing a storage; tied params stay one tensor),
    at the cost of one copy of those params while saving.

    Args:
        optimizers: the ``ShardedOptimizer`` s prepared with the accelerator (unwrapped).

    Raises:
        TypeError: an entry is not a ``ShardedOptimizer`` (accelerate's ``AcceleratedOptimizer``:
            pass the optimizer you built, not what ``prepare`` returned).
    """
    bad = [type(opt).__name__ for opt in optimizers if not isinstance(opt, ShardedOptimizer)]
    if bad or not optimizers:
        raise TypeError(f"save_state_pre_hook takes the ShardedOptimizers themselves (not what accelerator.prepare returns); got {bad or 'none'}")

    def hook(models: list[nn.Module], weights: list[dict[str, Any]], output_dir: str) -> None:
        for opt in optimizers:
            opt.consolidate_state_dict(to=0)
        for state_dict in weights:
            copies: dict[tuple[int, torch.Size, tuple[int, ...]], torch.Tensor] = {}
            for name, tensor in state_dict.items():
                if isinstance(tensor, torch.Tensor) and any(opt.holds_storage_of(tensor) for opt in optimizers):
                    key = (tensor.data_ptr(), tensor.shape, tensor.stride())
                    if key not in copies:
                        copies[key] = tensor.detach().clone()
                    state_dict[name] = copies[key]

    return hook
