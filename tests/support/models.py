"""A tiny model and data for the multi-process tests: odd sizes, tied weights, a frozen param,
and a branch that can be left out of a forward (an unused param)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 37


class TinyNet(nn.Module):
    def __init__(self, dim: int = 13, hidden: int = 29) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.branch = nn.Linear(dim, dim)
        self.frozen_scale = nn.Parameter(torch.linspace(0.5, 1.5, dim), requires_grad=False)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = self.embed(x) * self.frozen_scale
        h = h + self.fc2(torch.tanh(self.norm(self.fc1(h))))
        if use_branch:
            h = h + self.branch(h)
        return self.head(h)


def batch(rank: int, step: int, micro: int = 0, size: int = 4, seq: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic (input, target) pair of int64 [size, seq] for this rank, step and micro-step."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    x = torch.randint(0, VOCAB, (size, seq), generator=g)
    return x, torch.roll(x, 1, dims=1)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
    logits = model(x, use_branch=use_branch)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


def average_grads(model: nn.Module) -> None:
    """Replace every gradient of ``model`` with its mean over the ranks, as DDP leaves it (the reference of a test)."""
    import torch.distributed as dist

    for p in model.parameters():  # every param must have a gradient on every rank
        dist.all_reduce(p.grad)
        p.grad.div_(dist.get_world_size())


def param_groups(model: nn.Module) -> list[dict]:
    """Two groups as in GPT training: decay for matrices, none for vectors (frozen one included)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def tolerance_ratio(actual: nn.Module, expected: nn.Module, rtol: float = 1e-6, atol: float = 1e-7) -> float:
    """max over all params and elements of |a - e| / (atol + rtol |e|): <= 1 means within tolerance.

    Equal non-finite elements (NaN and NaN, inf and inf) count as equal; any other NaN or inf makes it inf.
    """
    worst = 0.0
    for a, e in zip(actual.parameters(), expected.parameters()):
        a, e = a.detach().double(), e.detach().double()
        ratio = (a - e).abs() / (atol + rtol * e.abs())
        same = (a == e) | (a.isnan() & e.isnan())
        ratio = torch.where(same, 0.0, ratio.nan_to_num(nan=math.inf))
        worst = max(worst, ratio.max().item() if ratio.numel() else 0.0)
    return worst


def relative_error(actual: nn.Module, expected: nn.Module) -> float:
    """||a - e|| / ||e|| over all params together, in float64."""
    num = sum(((a.detach().double() - e.detach().double()) ** 2).sum() for a, e in zip(actual.parameters(), expected.parameters()))
    den = sum((e.detach().double() ** 2).sum() for e in expected.parameters())
    return float((num / den).sqrt())
