"""Run with 2 ranks under torch.distributed.run (CPU, gloo): the plain HF Trainer with a ShardedOptimizer
against the same Trainer with plain AdamW (DDP) on a tiny Llama and real text, with max_grad_norm
(clipping every step, through accelerate's ``clip_grad_norm_``), gradient_accumulation_steps=2, a
linear LR schedule, save_steps and resume_from_checkpoint (with ``--resume-on-one-rank``: stage 2's
checkpoint resumed on 1 rank); stage 2 also with ``save_strategy="best"`` (saves decided after an
evaluation). The one zeroshard class is the checkpoint callback ``GatherOptimizerOnSave``. Rank 0 prints one
JSON line ``hf-result {...}`` for the parent test to check."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).parent))
from llama_text import TextDataset, tiny_llama, tolerance_ratio

import zeroshard
from zeroshard.comm import collectives
from zeroshard.integrations.hf import GatherOptimizerOnSave

STEPS, SAVE_STEPS = 6, 3


class CountReductions(TrainerCallback):
    """Counts zeroshard's gradient reduce-scatters during training, and those made in non-final accumulation micro-steps."""

    def __init__(self) -> None:
        self.calls = self.during_micro_steps = self._at_step_begin = 0
        self._real = collectives.reduce_scatter

    def _counting(self, *args, **kwargs):
        self.calls += 1
        return self._real(*args, **kwargs)

    def on_train_begin(self, args, state, control, **kwargs):
        collectives.reduce_scatter = self._counting

    def on_train_end(self, args, state, control, **kwargs):
        collectives.reduce_scatter = self._real

    def on_step_begin(self, args, state, control, **kwargs):
        self._at_step_begin = self.calls

    def on_substep_end(self, args, state, control, **kwargs):
        self.during_micro_steps += self.calls - self._at_step_begin


def train(out: Path, stage: int | None, resume: str | None = None, callbacks=(), batch_size: int = 2,
          best: bool = False, **extra) -> tuple[list[torch.Tensor], list[float]]:
    # best: evaluate every SAVE_STEPS steps and save when the eval loss is the highest yet (the Trainer decides after evaluating):
    # the first evaluation saves, the second (a lower loss) does not
    saving = {"save_strategy": "best", "eval_strategy": "steps", "eval_steps": SAVE_STEPS, "metric_for_best_model": "eval_loss",
              "greater_is_better": True} if best else {"save_strategy": "steps" if stage is not None else "no"}
    args = TrainingArguments(
        str(out), use_cpu=True, per_device_train_batch_size=batch_size, gradient_accumulation_steps=2, max_steps=STEPS,
        max_grad_norm=0.5, learning_rate=3e-3, lr_scheduler_type="linear", seed=0, logging_steps=1, report_to=[],
        disable_tqdm=True, save_steps=SAVE_STEPS, dataloader_num_workers=0, **saving, **extra,
    )
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)
    callbacks = list(callbacks)
    if stage is not None:
        opt = zeroshard.ShardedOptimizer(opt, stage=stage)
        callbacks.append(GatherOptimizerOnSave())
    trainer = Trainer(model=model, args=args, train_dataset=TextDataset(), eval_dataset=TextDataset(8) if best else None,
                      optimizers=(opt, None), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    norms = [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]
    return [p.detach().clone() for p in model.parameters()], norms


def main(out: Path) -> None:
    ddp, ddp_norms = train(out / "ddp", None)  # TrainingArguments initialized the gloo process group
    result = {"ddp_norms": ddp_norms}
    for stage in (1, 2):
        counter = CountReductions()
        sharded, norms = train(out / f"stage{stage}", stage, callbacks=[counter])
        resumed, _ = train(out / f"stage{stage}", stage, resume=str(out / f"stage{stage}" / f"checkpoint-{SAVE_STEPS}"))
        result[f"stage{stage}"] = {
            "vs_ddp": tolerance_ratio(sharded, ddp), "resumed_vs_uninterrupted": tolerance_ratio(resumed, sharded),
            "norms": norms, "reduce_scatters": counter.calls, "during_micro_steps": counter.during_micro_steps,
        }
    # save_strategy="best": the checkpoint saved after the first evaluation holds the full state (each rank's own shard before)
    gathers = []
    consolidate = zeroshard.ShardedOptimizer.consolidate_state_dict
    zeroshard.ShardedOptimizer.consolidate_state_dict = lambda self, *args, **kwargs: (gathers.append(1), consolidate(self, *args, **kwargs))[1]
    try:
        train(out / "model-only", 2, best=True, save_only_model=True)  # its checkpoints hold no optimizer: nothing to gather
        only_model = len(gathers)
        best, _ = train(out / "best", 2, best=True)
    finally:
        zeroshard.ShardedOptimizer.consolidate_state_dict = consolidate
    resumed, _ = train(out / "best", 2, resume=str(out / "best" / f"checkpoint-{SAVE_STEPS}"), best=True)
    result["best"] = {"resumed_vs_uninterrupted": tolerance_ratio(resumed, best), "gathers": len(gathers) - only_model, "only_model": only_model,
                      "checkpoints": sorted(path.name for path in (out / "best").glob("checkpoint-*"))}
    if dist.get_rank() == 0:
        result["best"]["saved_state_entries"] = len(torch.load(out / "best" / f"checkpoint-{SAVE_STEPS}" / "optimizer.pt", weights_only=False)["state"])
        torch.save(sharded, out / "stage2-uninterrupted.pt")
        print("hf-result " + json.dumps(result), flush=True)


def resume_on_one_rank(out: Path) -> None:
    """Resume stage 2's 2-rank checkpoint on 1 rank with batch 4: the same samples per micro-step (the
    seeded sampler's order, split 2 + 2 before), so the run should end where the 2-rank one did."""
    resumed, _ = train(out / "stage2", 2, resume=str(out / "stage2" / f"checkpoint-{SAVE_STEPS}"), batch_size=4)
    uninterrupted = torch.load(out / "stage2-uninterrupted.pt")
    result = {"world_size": dist.get_world_size() if dist.is_initialized() else 1, "vs_uninterrupted": tolerance_ratio(resumed, uninterrupted)}
    print("hf-result " + json.dumps(result), flush=True)


if __name__ == "__main__":
    if sys.argv[2:] == ["--resume-on-one-rank"]:
        resume_on_one_rank(Path(sys.argv[1]))
    else:
        main(Path(sys.argv[1]))
