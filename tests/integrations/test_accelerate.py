"""A plain accelerate loop with a ShardedOptimizer against ``Accelerator`` + AdamW (DDP); checkpoints
through ``zeroshard.integrations.accelerate.save_state_pre_hook``: the loop runs in
``accelerate_child.py`` under torchrun (2 gloo ranks)."""

from __future__ import annotations

import pytest
from torchrun_child import run_child

pytest.importorskip("accelerate")
pytest.importorskip("transformers")


def test_accelerate_loop_matches_ddp_with_accumulate_clip_and_save_load_state(tmp_path):
    result = run_child("accelerate_child.py", str(tmp_path), result_prefix="accelerate-result")
    assert result["distributed"]  # Accelerator(cpu=True) under torchrun: 2 ranks, DDP-wrapped model
    assert min(result["ddp_norms"]) > 0.5 * 1.5  # clip_grad_norm_(..., 0.5) clipped every step
    assert result["vs_ddp"] <= 1.0, result  # rtol 1e-6 (atol 1e-7) after 8 steps
    assert result["norms"] == pytest.approx(result["ddp_norms"], rel=1e-6)
    assert result["resumed_vs_uninterrupted"] == 0.0, result  # save_state/load_state with defaults: bitwise
    assert result["saved_model"] == {"missing": [], "vs_trained": 0.0}, result  # save_model inside params_own_storage(): every param
