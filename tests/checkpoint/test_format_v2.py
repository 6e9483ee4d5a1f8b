"""Sharded checkpoints of format version 2, whose buckets hold the params packed end to end (format 3 starts each param
on a 64-byte boundary, ``zeroshard.layout.partition.param_align``).

``data/v2_flat`` is a DCP checkpoint saved at 2 ranks by zeroshard ``a9b727b`` (format version 2):
``nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2))`` with ``torch.manual_seed(0)``, weights and biases in two
``AdamW(lr=1e-2)`` groups (biases without weight decay), stage 2, three steps, saved as ``{"model": ..., "optim": opt}``;
``data/v2_expected_full.pt`` holds that run's ``consolidate_state_dict(to=0)`` and model. Its params (2, 6, 3 and 15
elements) start 16 fp32 elements apart in format 3, so its bucket has gaps now: the converter reads it, a load names it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import zeroshard
from zeroshard.convert import convert, load_checkpoint, optimizer_to_torch
from zeroshard.layout.partition import build_layout

DATA = Path(__file__).parent / "data"


def _model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2))
    groups = [{"params": [p for p in model.parameters() if p.dim() > 1]},
              {"params": [p for p in model.parameters() if p.dim() == 1], "weight_decay": 0.0}]
    return model, zeroshard.ShardedOptimizer(torch.optim.AdamW(groups, lr=1e-2), stage=2)


def _assert_same_optimizer_state(got: dict, expected: dict) -> None:
    assert got["param_groups"] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys()
    for index, entry in expected["state"].items():
        assert got["state"][index].keys() == entry.keys(), index
        for key, value in entry.items():
            assert torch.equal(got["state"][index][key], value), (index, key)


def test_the_converter_reads_format_2_bitwise():
    converted = optimizer_to_torch(load_checkpoint(DATA / "v2_flat")["optim"])
    expected = torch.load(DATA / "v2_expected_full.pt", weights_only=False)["optim"]
    _assert_same_optimizer_state(converted, expected)
    assert len(expected["state"]) == 4 and all(int(entry["step"]) == 3 for entry in expected["state"].values())


def format_2_worker(out: str) -> None:
    model, opt = _model_and_optimizer()
    with pytest.raises(ValueError, match=r"format version 2, whose buckets hold the params packed.*python -m zeroshard\.convert CHECKPOINT OUT"):
        zeroshard.verify_checkpoint(DATA / "v2_flat", opt)
    with pytest.raises(CheckpointException, match=r"Size mismatch between saved torch.Size\(\[21\]\) and current: torch.Size\(\[31\]\) for optim.buckets.0.0"):
        # dcp.load checks sizes before it reads an entry: DCP's own words, the only ones before zeroshard reads the version
        dcp.load({"optim": opt}, checkpoint_id=str(DATA / "v2_flat"))
    convert(DATA / "v2_flat", out)  # the way out the error names: the full format, which loads at any world size
    converted = torch.load(out, weights_only=False)
    model.load_state_dict(converted["model"])
    opt.load_state_dict(converted["optim"])
    opt.consolidate_state_dict(to=0)
    _assert_same_optimizer_state(opt.state_dict(), torch.load(DATA / "v2_expected_full.pt", weights_only=False)["optim"])


def test_a_format_2_checkpoint_with_gaps_now_names_the_converter_and_converts(pools, tmp_path):
    pools[1].run(format_2_worker, str(tmp_path / "full.pt"))


def packed_worker() -> None:
    """Format 2 of a model whose params all start 64 bytes apart, or whose one odd-sized param ends its bucket: its buckets
    are format 3's, and it loads as it is."""
    torch.manual_seed(0)
    for model, width in ((nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 32)), 16), (nn.Linear(13, 1, bias=False), 13)):
        opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), stage=2)
        model(torch.randn(4, width)).sum().backward()
        opt.step()
        saved = opt.state_dict()
        saved["zeroshard"]["version"] = 2
        opt.load_state_dict(copy.deepcopy(saved))
    _, gapped = _model_and_optimizer()
    gapped_saved = gapped.state_dict()
    gapped_saved["zeroshard"]["version"] = 2
    with pytest.raises(ValueError, match="format version 2, whose buckets hold the params packed"):
        gapped.load_state_dict(gapped_saved)


def test_format_2_of_a_model_without_gaps_loads(pools):
    assert [s.offset for s in build_layout([512, 32, 256, 16], 10**6, 2, align=16).slots] == [0, 512, 544, 800]  # packed = aligned here
    pools[2].run(packed_worker)
