"""Lightning's Trainer and Fabric with a ShardedOptimizer (``zeroshard.integrations.lightning``) against
the same runs with ``strategy="ddp"`` + AdamW: the runs are in ``lightning_child.py`` under torchrun
(2 gloo ranks)."""

from __future__ import annotations

import pytest
from torchrun_child import run_child

pytest.importorskip("lightning")
pytest.importorskip("transformers")

MAX_NORM = 0.05  # lightning_child.MAX_NORM


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    result = run_child("lightning_child.py", str(tmp_path_factory.mktemp("lightning")), result_prefix="lightning-result")
    assert result["distributed"]
    return result


@pytest.mark.parametrize("loop", ["trainer", "fabric"])
def test_lightning_trains_like_ddp_with_accumulation_clipping_and_resume(result, loop):
    run = result[loop]
    assert min(run["ddp_norms"]) > 10 * MAX_NORM  # DDP clipped every step, so equal params mean zeroshard did too
    assert run["vs_ddp"] <= 1.0, run  # rtol 1e-6: the norm is summed in another order (shards vs params)
    assert run["resumed_vs_uninterrupted"] == 0.0, run  # a checkpoint after epoch 1, resumed: bitwise
    if loop == "fabric":  # fabric.clip_gradients returns the global pre-clip norm
        assert run["norms"] == pytest.approx(run["ddp_norms"], rel=1e-5)


def test_lightning_refuses_what_a_sharded_optimizer_cannot_honour(result):
    # Lightning's own DDPStrategy clips the optimizer's params' .grad: an error, never a silent no-op.
    assert "opt.clip_grad_norm_" in result["plain_ddp_strategy_clipping"] and "docs/integrations.md" in result["plain_ddp_strategy_clipping"]
    for refused in (result["clip_by_value"], result["fabric_clip_by_value"]):
        assert refused.startswith("ValueError: clipping by value"), refused
