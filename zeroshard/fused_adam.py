"""The fused Adam/AdamW step on this rank's flat shards (one kernel pass per contiguous run).

See [Note: zeroshard buffers] in ``zeroshard/flat_buffer.py``.

For ``torch.optim.Adam`` and ``AdamW`` without ``amsgrad``, ``capturable`` or ``differentiable``,
``exp_avg`` and ``exp_avg_sq`` live in one flat fp32 buffer per shard (in host memory, beside the
host master, with ``offload="cpu"``, where every update runs torch's fused CPU AdamW), and the wrapped optimizer's
``state[virtual_param]`` entries are views of them — so ``state_dict()``, checkpoints and LR
schedulers see ordinary ``torch.optim`` state while the update runs over whole runs of pieces
with :func:`zeroshard.kernels.fused_adamw_` on CUDA (16-bit params receive the cast of the updated
master in the same pass, ``param_out``), and with torch's own functional Adam/AdamW elsewhere
(the ``foreach``/``fused`` implementation the user configured). A run is a maximal sequence of
adjacent pieces of one bucket that got a gradient and share a step count.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim.adam import adam as functional_adam
from torch.optim.adamw import adamw as functional_adamw

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

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str, offload: bool = False) -> None:
        self.optimizer = optimizer
        self.adamw = kind == "adamw"
        self.offload = offload
        self.exp_avg: dict[int, Tensor] = {}
        self.exp_avg_sq: dict[int, Tensor] = {}
        self.host_grad: dict[int, Tensor] = {}  # offload: 1-D master dtype, the grad shard's host copy

    def _bind(self, k: int, shard: LocalShard) -> None:
        """Make every piece's ``exp_avg``/``exp_avg_sq`` a view of the flat buffers (copying loaded state in)."""
        if k not in self.exp_avg:
            home = shard.master.device if self.offload else shard.grad_shard.device
            self.exp_avg[k] = torch.zeros(shard.grad_shard.numel(), dtype=torch.float32, device=home)
            self.exp_avg_sq[k] = torch.zeros(shard.grad_shard.numel(), dtype=torch.float32, device=home)
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
    def step(self, shards: list[LocalShard], group_of_shard: list[int], steps: list[list[int]], grad_scale: Tensor | None) -> None:
        """Update every used piece of every shard; unused pieces and their state stay untouched.

        CUDA shards take the Triton kernel, one launch per run. Other devices take torch's own
        functional Adam/AdamW with the wrapped optimizer's ``foreach``/``fused`` flags, one call
        per param group and step count with the runs as its tensor list: the implementation the
        user configured, on the flat shard.

        Args:
            shards: this rank's shards.
            group_of_shard: for each shard, the index of its param group (hyperparameters).
            steps: per shard, per param: its step number after this update (the optimizer's
                replicated host count), or 0 when it got no gradient on any rank.
            grad_scale: 1-element fp32 tensor multiplied into the gradients, or ``None``.
        """
        for k, shard in enumerate(shards):
            self._bind(k, shard)
            if self.offload:
                self._copy_grads_to_host(k, shard)
            group = self.optimizer.param_groups[group_of_shard[k]]
            runs = [self._run_tensors(k, shard, *run) for run in self._runs(k, shard, steps[k])]
            if shard.grad_shard.device.type == "cuda" and not self.offload:
                for param, grad, exp_avg, exp_avg_sq, param_out, step in runs:
                    fused_adamw_(
                        param, grad, exp_avg, exp_avg_sq, lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                        eps=group["eps"], weight_decay=group["weight_decay"], step=step, grad_scale=grad_scale,
                        param_out=param_out, maximize=group.get("maximize", False), adamw=self.adamw,
                    )
                continue
            for step in sorted({run[-1] for run in runs}):
                batch = [run for run in runs if run[-1] == step]
                if grad_scale is not None:
                    for run in batch:
                        run[1].mul_(grad_scale)
                functional = functional_adamw if self.adamw else functional_adam
                functional(
                    [r[0] for r in batch], [r[1] for r in batch], [r[2] for r in batch], [r[3] for r in batch], [],
                    [torch.tensor(float(step - 1)) for _ in batch],  # torch advances them to ``step``
                    # Offload always takes torch's fused CPU kernel; otherwise the user's implementation.
                    foreach=None if self.offload else group.get("foreach"), fused=True if self.offload else group.get("fused"),
                    amsgrad=False, beta1=group["betas"][0],
                    beta2=group["betas"][1], lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                    maximize=group.get("maximize", False),
                )
                for param, _, _, _, param_out, _ in batch:
                    if param_out is not None:
                        param_out.copy_(param)

    def _run_tensors(self, k: int, shard: LocalShard, start: int, end: int, step: int):
        """(param, grad, exp_avg, exp_avg_sq, param_out or None, step) views for pieces ``[start, end)``."""
        first, last = shard.pieces[start], shard.pieces[end - 1]
        lo, hi = first.shard_offset, last.shard_offset + last.numel
        flat = shard.buffer.data[first.flat_offset : first.flat_offset + hi - lo]
        param, param_out = (flat, None) if shard.master is None else (shard.master[lo:hi], flat)
        grad = (self.host_grad[k] if self.offload else shard.grad_shard)[lo:hi]
        return param, grad, self.exp_avg[k][lo:hi], self.exp_avg_sq[k][lo:hi], param_out, step

    def _copy_grads_to_host(self, k: int, shard: LocalShard) -> None:
        """Offload: bring the reduced grad shard to host memory (pinned, asynchronous, when on CUDA)."""
        if k not in self.host_grad:
            pin = shard.grad_shard.device.type == "cuda"
            self.host_grad[k] = torch.empty(shard.grad_shard.numel(), dtype=shard.grad_shard.dtype, device="cpu", pin_memory=pin)
        self.host_grad[k].copy_(shard.grad_shard, non_blocking=True)
        if shard.grad_shard.device.type == "cuda":
            # The CPU update reads the host copy: the device-to-host copy must have landed.
            torch.cuda.current_stream(shard.grad_shard.device).synchronize()

    def _runs(self, k: int, shard: LocalShard, steps: list[int]):
        """(first piece, end piece, step) of each run; records the new step of every used piece.

        Steps come from the host counts in ``steps``, never from reading ``state["step"]`` (which
        torch may keep on the device): no host-device synchronization per piece.
        """
        layout = shard.buffer.layout
        run_start, run_step, run_bucket = None, None, None
        for i, (piece, vparam) in enumerate(zip(shard.pieces, shard.virtual_params)):
            step = steps[piece.param]
            if not step:
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
            state["step"].fill_(float(step))
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

    def host_grad_tensors(self) -> list[Tensor]:
        """Offload: the host copies of the grad shards (for memory accounting)."""
        return list(self.host_grad.values())
