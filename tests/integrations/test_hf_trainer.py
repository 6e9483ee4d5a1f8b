"""The plain HF Trainer with a ShardedOptimizer against the same Trainer with AdamW (DDP); checkpoints
through ``zeroshard.integrations.hf.GatherOptimizerOnSave``.

The run itself is ``hf_trainer_child.py`` under torchrun (2 gloo ranks): TrainingArguments sets up
the process group and the Trainer its DDP wrapper, as in a user's script.
"""

from __future__ import annotations

import pytest
from torchrun_child import run_child

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def test_trainer_matches_ddp_trainer_with_clipping_accumulation_and_resume(tmp_path):
    result = run_child("hf_trainer_child.py", str(tmp_path), result_prefix="hf-result")
    ddp_norms = result["ddp_norms"]
    assert min(ddp_norms) > 0.5 * 1.5  # max_grad_norm=0.5 clipped every step
    for stage in ("stage1", "stage2"):
        r = result[stage]
        assert r["vs_ddp"] <= 1.0, (stage, r)  # params within rtol 1e-6 (atol 1e-7) of the DDP Trainer's after 6 steps
        assert r["resumed_vs_uninterrupted"] == 0.0, (stage, r)  # save_steps=3 + resume_from_checkpoint: bitwise equal
        assert r["norms"] == pytest.approx(ddp_norms, rel=1e-6)  # the logged grad_norm is the global pre-clip norm
        assert r["reduce_scatters"] > 0 and r["during_micro_steps"] == 0, (stage, r)  # accumulation reduces once per step
    # save_strategy="best" (the Trainer decides after evaluating): the checkpoint is whole (rank 0's shard before) and resumes
    assert result["best"]["saved_state_entries"] > 0 and result["best"]["resumed_vs_uninterrupted"] == 0.0, result["best"]
    # one gather, for the one save: not at the second evaluation, which is not the best (the state would be held on rank 0)
    assert result["best"]["gathers"] == 1 and result["best"]["checkpoints"] == ["checkpoint-3"], result["best"]
    assert result["best"]["only_model"] == 0, result["best"]  # save_only_model=True: the checkpoint holds no optimizer state
    # The same checkpoint resumed on 1 rank with batch 4 (the same samples per micro-step as 2 x 2):
    # the optimizer.pt written at 2 ranks loads at 1 and the run ends where the 2-rank one did.
    one_rank = run_child("hf_trainer_child.py", str(tmp_path), "--resume-on-one-rank", result_prefix="hf-result", nproc=1)
    assert one_rank["world_size"] == 1 and one_rank["vs_uninterrupted"] <= 1.0, one_rank  # rtol 1e-6: the batch is summed in another order
