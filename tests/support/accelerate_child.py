"""Run with 2 ranks under torch.distributed.run (CPU, gloo): a plain accelerate training loop with a
ShardedOptimizer against the same loop with plain AdamW (DDP): ``prepare(model, opt, dataloader,
scheduler)``, ``accumulate`` (2 micro-steps), ``accelerator.clip_grad_norm_`` every step, and
``save_state``/``load_state`` with their defaults (safetensors), on a tiny Llama and real text. The
one zeroshard call is the checkpoint hook (``register_save_state_pre_hook(save_state_pre_hook(opt))``);
at the end ``save_model`` inside ``opt.params_own_storage()``, as docs/integrations.md says.
Rank 0 prints one JSON line ``accelerate-result {...}`` for the parent test."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from llama_text import TextDataset, tiny_llama, tolerance_ratio

import zeroshard
from zeroshard.integrations.accelerate import save_state_pre_hook

STEPS, SAVE_AT, ACCUMULATION, MAX_NORM = 8, 4, 2, 0.5


def train(sharded: bool, save_dir: Path | None = None, resume_dir: Path | None = None,
          model_dir: Path | None = None) -> tuple[list[torch.Tensor], list[float]]:
    """STEPS optimizer steps; save_state after SAVE_AT of them into ``save_dir``, or start there from ``resume_dir``;
    ``save_model`` into ``model_dir`` at the end."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)
    if sharded:
        opt = own = zeroshard.ShardedOptimizer(opt)
        accelerator.register_save_state_pre_hook(save_state_pre_hook(opt))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / (4 * STEPS))
    loader = torch.utils.data.DataLoader(TextDataset(), batch_size=2)
    model, opt, loader, schedule = accelerator.prepare(model, opt, loader, schedule)
    done = 0
    if resume_dir is not None:
        accelerator.load_state(str(resume_dir))
        done = SAVE_AT
        loader = accelerator.skip_first_batches(loader, SAVE_AT * ACCUMULATION)
    norms = []
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM).item())
            opt.step()
            schedule.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            done += 1
            if done == SAVE_AT and save_dir is not None:
                accelerator.save_state(str(save_dir))
            if done == STEPS:
                break
    if model_dir is not None:
        with own.params_own_storage():  # accelerate's safetensors cleanup keeps one tensor per storage: 1 of the params, silently
            accelerator.save_model(model, str(model_dir))
    return [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()], norms


def main(out: Path) -> None:
    ddp, ddp_norms = train(False)
    sharded, norms = train(True, save_dir=out / "state", model_dir=out / "model")
    resumed, _ = train(True, resume_dir=out / "state")
    result = {
        "ddp_norms": ddp_norms, "norms": norms, "distributed": dist.is_initialized() and dist.get_world_size() == 2,
        "vs_ddp": tolerance_ratio(sharded, ddp),
        "resumed_vs_uninterrupted": tolerance_ratio(resumed, sharded),
    }
    saved = load_file(out / "model" / "model.safetensors")
    names = [name for name, _ in tiny_llama().named_parameters()]
    kept = [(saved[name], p) for name, p in zip(names, sharded) if name in saved]
    result["saved_model"] = {"missing": sorted(set(names) - set(saved)), "vs_trained": tolerance_ratio(*map(list, zip(*kept)))}
    if dist.get_rank() == 0:
        print("accelerate-result " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
