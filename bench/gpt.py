"""The example GPT (examples/train_gpt.py), loaded from its file so the benchmark trains the same model."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"


def _example_module():
    spec = importlib.util.spec_from_file_location("zeroshard_train_gpt", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_embd: int
    n_head: int
    seq_len: int
    batch_size: int  # sequences per rank

    def __str__(self) -> str:
        return (f"GPT {self.n_layer} layers, {self.n_embd} wide, {self.n_head} heads, sequence {self.seq_len}, "
                f"{self.batch_size} sequences per rank")


QUICK = GPTConfig(n_layer=2, n_embd=128, n_head=4, seq_len=64, batch_size=8)
FULL_CPU = GPTConfig(n_layer=4, n_embd=256, n_head=4, seq_len=128, batch_size=8)
FULL_GPU = GPTConfig(n_layer=12, n_embd=768, n_head=12, seq_len=1024, batch_size=8)
LARGE_CPU = GPTConfig(n_layer=8, n_embd=512, n_head=8, seq_len=128, batch_size=8)
LARGE_GPU = GPTConfig(n_layer=24, n_embd=1024, n_head=16, seq_len=1024, batch_size=4)


def build(config: GPTConfig, device: torch.device, seed: int = 0) -> nn.Module:
    """The example's GPT with ``config``'s sizes, fp32, on ``device``; same weights for the same seed."""
    torch.manual_seed(seed)
    return _example_module().GPT(config.n_layer, config.n_embd, config.n_head, config.seq_len).to(device)


def batch(config: GPTConfig, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random (inputs, targets) pair of int64 [batch_size, seq_len] for ``rank``."""
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randint(0, 256, (config.batch_size, config.seq_len + 1), generator=g)
    return x[:, :-1].to(device), x[:, 1:].to(device)


def decay_groups(model: nn.Module) -> list[dict]:
    """The example's two AdamW groups: weight decay for matrices, none for vectors."""
    return [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
