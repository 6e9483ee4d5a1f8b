"""The fused Adam/AdamW step on this rank's flat shards (one kernel pass per contiguous run).

See [Note: zeroshard buffers] in ``zeroshard/flat_buffer.py``.

For ``torch.optim.Adam`` and ``AdamW`` without ``amsgrad``, ``capturable`` or ``differentiable``,
``exp_avg`` and ``exp_avg_sq`` live in one flat fp32 buffer per shard, and the wrapped optimizer's
``state[virtual_param]`` entries are views of them — so ``state_dict()``, checkpoints and LR
schedulers see ordinary ``torch.optim`` state while the update runs over whole runs of pieces
with :func:`zeroshard.kernels.fused_adamw_`. A run is a maximal sequence of adjacent pieces of one
bucket that got a gradient and share a step count; 16-bit params receive the cast of the updated
master in the same pass (``param_out``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from zeroshard.kernels import fused_adamw_
from zeroshard.local_shard import LocalShard


def fused_adam_kind(optimizer: torch.optim.Optimizer) -> str | None:
    """``"adamw"`` or ``"adam"`` when ``optimizer`` can take the fused path, else ``None``."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return None
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("capturable") or group.get("differentiable"):
            return None
        if isinstance(group["lr"], Tensor) or any(isinstance(b, Tensor) for b in group["betas"]):
            return None
    decoupled = type(optimizer) is torch.optim.AdamW or optimizer.defaults.get("decoupled_weight_decay", False)
    return "adamw" if decoupled else "adam"


class FusedAdam:
    """Flat moment buffers for every shard, and the fused update over them.

    Attributes:
        exp_avg, exp_avg_sq: per shard, 1-D fp32 ``shard_numel`` elements (allocated on first use).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str) -> None:
        self.optimizer = optimizer
        self.adamw = kind == "adamw"
        self.exp_avg: dict[int, Tensor] = {}
        self.exp_avg_sq: dict[int, Tensor] = {}

    def _bind(self, k: int, shard: LocalShard) -> None:
        """Make every piece's ``exp_avg``/``exp_avg_sq`` a view of the flat buffers (copying loaded state in)."""
        if k not in self.exp_avg:
            self.exp_avg[k] = torch.zeros_like(shard.grad_shard, dtype=torch.float32)
            self.exp_avg_sq[k] = torch.zeros_like(shard.grad_shard, dtype=torch.float32)
        for piece, vparam in zip(shard.pieces, shard.virtual_params):
            state = self.optimizer.state.get(vparam)
            if not state:
                continue
            for key, flat in (("exp_avg", self.exp_avg[k]), ("exp_avg_sq", self.exp_avg_sq[k])):
                view = flat[piece.shard_offset : piece.shard_offset + piece.numel]
                if state[key].data_ptr() != view.data_ptr():  # fresh from load_state_dict
                    view.copy_(state[key].reshape(-1))
                    state[key] = view

    @torch.no_grad()
    def step(self, shards: list[LocalShard], group_of_shard: list[int], used: list[list[bool]], grad_scale: Tensor | None) -> None:
        """Update every used piece of every shard; unused pieces and their state stay untouched.

        Args:
            shards: this rank's shards.
            group_of_shard: for each shard, the index of its param group (hyperparameters).
            used: per shard, per param: whether it got a gradient on some rank.
            grad_scale: 1-element fp32 tensor multiplied into the gradients, or ``None``.
        """
        for k, shard in enumerate(shards):
            self._bind(k, shard)
            group = self.optimizer.param_groups[group_of_shard[k]]
            for start, end, step in self._runs(k, shard, used[k]):
                first = shard.pieces[start]
                last = shard.pieces[end - 1]
                lo, hi = first.shard_offset, last.shard_offset + last.numel
                flat_lo = first.flat_offset
                if shard.master is None:
                    param, param_out = shard.buffer.data[flat_lo : flat_lo + hi - lo], None
                else:
                    param, param_out = shard.master[lo:hi], shard.buffer.data[flat_lo : flat_lo + hi - lo]
                fused_adamw_(
                    param, shard.grad_shard[lo:hi], self.exp_avg[k][lo:hi], self.exp_avg_sq[k][lo:hi],
                    lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                    weight_decay=group["weight_decay"], step=step, grad_scale=grad_scale, param_out=param_out,
                    maximize=group.get("maximize", False), adamw=self.adamw,
                )

    def _runs(self, k: int, shard: LocalShard, used: list[bool]):
        """(first piece, end piece, step) of each run; advances the step of every used piece."""
        layout = shard.buffer.layout
        run_start, run_step, run_bucket = None, None, None
        for i, (piece, vparam) in enumerate(zip(shard.pieces, shard.virtual_params)):
            if not used[piece.param]:
                if run_start is not None:
                    yield run_start, i, run_step
                run_start = None
                continue
            state = self.optimizer.state[vparam]
            if not state:
                lo = piece.shard_offset
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = self.exp_avg[k][lo : lo + piece.numel]
                state["exp_avg_sq"] = self.exp_avg_sq[k][lo : lo + piece.numel]
            state["step"] += 1
            step = int(state["step"].item())
            bucket = layout.slots[piece.param].bucket
            adjacent = run_start is not None and shard.pieces[i - 1].shard_offset + shard.pieces[i - 1].numel == piece.shard_offset
            if run_start is not None and (step != run_step or bucket != run_bucket or not adjacent):
                yield run_start, i, run_step
                run_start = None
            if run_start is None:
                run_start, run_step, run_bucket = i, step, bucket
        if run_start is not None:
            yield run_start, len(shard.pieces), run_step

    def state_tensors(self) -> list[Tensor]:
        """The flat moment buffers (for memory accounting)."""
        return list(self.exp_avg.values()) + list(self.exp_avg_sq.values())
