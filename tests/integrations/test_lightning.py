"""Lightning's Trainer and Fabric with a ShardedOptimizer and their plain ``strategy="ddp"``, against the
same runs with AdamW: the runs are in ``lightning_child.py`` under torchrun (2 gloo ranks). No zeroshard
class but the finetuning callbacks (``zeroshard.integrations.lightning``): Lightning clips the
optimizer's ``param_groups`` (``VirtualGrad`` s) and the model's gradients (``ShardedGrad`` s) with
torch's own code, and gathers the optimizer state for its checkpoints through
``consolidate_state_dict()``."""

from __future__ import annotations

import pytest
import torch
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
    assert run["vs_ddp"] <= 1.0, run  # rtol 1e-6, atol 1e-6: the norm is summed in another order (shards vs params)
    assert run["resumed_vs_uninterrupted"] == 0.0, run  # a checkpoint after epoch 1, resumed: bitwise
    # The logged norm (Trainer: get_total_norm over the model's params before clipping; Fabric: what
    # clip_gradients returns) is DDP's global pre-clip norm.
    assert run["norms"] == pytest.approx(run["ddp_norms"], rel=1e-5)


def test_finetuning_callbacks_unfreeze_into_a_sharded_optimizer_and_resume(result):
    # zeroshard.integrations.lightning's BaseFinetuning (Lightning's raises KeyError naming a virtual param at the epoch it
    # adds a group): the backbone joins at epoch 1 and trains as under DDP + AdamW, bitwise; BackboneFinetuning resumed
    # after the unfreezing adds the group again, trainable, and goes on bitwise as the uninterrupted run.
    run = result["finetune"]
    assert run["same_on_all_ranks"] and run["backbone_trained"], run
    assert run["vs_ddp"] == 0.0 and run["resumed_vs_uninterrupted"] == 0.0, run


def filter_worker() -> tuple[list[bool], list[bool], list[str]]:
    import warnings

    from lightning.pytorch.callbacks import BaseFinetuning as LightningFinetuning
    from torch import nn

    import zeroshard
    from zeroshard.integrations.lightning import BaseFinetuning

    head = nn.Linear(4, 3)
    nn.init.zeros_(head.bias)
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(head.parameters()))
    new_bias = nn.Parameter(torch.zeros(3))  # the values of the head's bias (a virtual param here), not the same param
    candidates = [new_bias, head.weight]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = BaseFinetuning.filter_on_optimizer(opt, candidates)
        lightnings = LightningFinetuning.filter_on_optimizer(opt, candidates)
    return [any(p is c for p in ours) for c in candidates], [any(p is c for p in lightnings) for c in candidates], [str(w.message) for w in caught]


def test_finetuning_skips_params_already_in_a_group_by_identity_and_warns(pools):
    # Lightning's filter compares values: a new param equal to a virtual param of the optimizer (zero biases) is skipped, and
    # a held param is not recognised in a ShardedOptimizer's virtual params.
    ours, lightnings, warned = pools[1].run(filter_worker)[0]
    assert ours == [True, False] and lightnings == [False, True]
    assert sum("already exist within another group" in w for w in warned) == 2


def test_lightning_clips_by_value_like_ddp(result):
    assert result["clip_by_value_vs_ddp"] <= 1.0, result
