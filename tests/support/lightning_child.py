"""Run with 2 ranks under torch.distributed.run (CPU, gloo): Lightning's Trainer and Fabric with a
ShardedOptimizer and their plain ``strategy="ddp"`` against the same runs with plain AdamW, on a
tiny Llama and real text: gradient accumulation (2 micro-steps), clipping every step (by norm; the
Trainer also by value), the gradient norm logged before each step, and a checkpoint after the first
epoch resumed to the end of the second (``ckpt_path``; ``fabric.save``/``fabric.load``). No zeroshard
class: Lightning gathers the optimizer state for its checkpoints through ``consolidate_state_dict()``
itself. Rank 0 prints one JSON line ``lightning-result {...}`` for the parent test."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from llama_text import TextDataset, tiny_llama, tolerance_ratio

import zeroshard

# 16 sequences, 2 ranks, batch 2, 2 micro-steps: 2 optimizer steps an epoch.
N_SEQUENCES, BATCH, ACCUMULATION, MAX_NORM = 16, 2, 2, 0.05


def adamw(params, sharded: bool) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, foreach=False)
    return zeroshard.ShardedOptimizer(opt) if sharded else opt


def loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(TextDataset(N_SEQUENCES), batch_size=BATCH)


class LitLlama(L.LightningModule):
    def __init__(self, sharded: bool) -> None:
        super().__init__()
        self.model, self.sharded, self.norms = tiny_llama(), sharded, []

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return adamw(self.model.parameters(), self.sharded)

    def on_before_optimizer_step(self, optimizer) -> None:  # before clipping, on every rank
        self.norms.append(torch.nn.utils.get_total_norm([p.grad for p in self.parameters()]).item())


def fit(sharded: bool, epochs: int, save: Path | None = None, resume: Path | None = None, **trainer_args) -> tuple[list[torch.Tensor], list[float]]:
    module = LitLlama(sharded)
    trainer_args.setdefault("gradient_clip_val", MAX_NORM)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=epochs,
        accumulate_grad_batches=ACCUMULATION, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **trainer_args,
    )
    trainer.fit(module, loader(), ckpt_path=str(resume) if resume else None)
    if save is not None:
        trainer.save_checkpoint(str(save))
    return [p.detach().clone() for p in module.model.parameters()], module.norms


def fabric_run(sharded: bool, epochs: int, save: Path | None = None, resume: Path | None = None) -> tuple[list[torch.Tensor], list[float]]:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    model = tiny_llama()
    model, opt = fabric.setup(model, adamw(model.parameters(), sharded))
    data = fabric.setup_dataloaders(loader())
    state = {"model": model, "optimizer": opt, "epoch": 0}
    if resume is not None:
        fabric.load(str(resume), state)
    norms = []
    for _ in range(state["epoch"], epochs):
        for i, batch in enumerate(data):
            last = i % ACCUMULATION == ACCUMULATION - 1
            with fabric.no_backward_sync(model, enabled=not last):
                fabric.backward(model(**batch).loss)
            if last:
                norms.append(fabric.clip_gradients(model, opt, max_norm=MAX_NORM).item())
                opt.step()
                opt.zero_grad()
        state["epoch"] += 1
    if save is not None:
        fabric.save(str(save), state)
    return [p.detach().clone() for p in model.parameters()], norms


def main(out: Path) -> None:
    result = {}
    ddp, _ = fit(False, 1, gradient_clip_algorithm="value", gradient_clip_val=1e-3)
    sharded, _ = fit(True, 1, gradient_clip_algorithm="value", gradient_clip_val=1e-3)
    result["clip_by_value_vs_ddp"] = tolerance_ratio(sharded, ddp)
    for name, run in (("trainer", fit), ("fabric", fabric_run)):
        ddp, ddp_norms = run(False, 2)
        sharded, norms = run(True, 2)
        run(True, 1, save=out / f"{name}.ckpt")
        resumed, _ = run(True, 2, resume=out / f"{name}.ckpt")
        result[name] = {
            # atol 1e-6: the clip's norm sums shards where DDP sums params, so the clip coefficients differ in the last bits; after 4
            # AdamW steps elements near zero of the embedding end up to 2e-7 apart on an AVX-512 CPU (bitwise without the clip).
            "ddp_norms": ddp_norms, "norms": norms, "vs_ddp": tolerance_ratio(sharded, ddp, atol=1e-6),
            "resumed_vs_uninterrupted": tolerance_ratio(resumed, sharded),
        }
    result["distributed"] = dist.is_initialized() and dist.get_world_size() == 2
    if dist.get_rank() == 0:
        print("lightning-result " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
