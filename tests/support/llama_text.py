"""A tiny LlamaForCausalLM built from a config (no download) and real text for the framework tests.

The text is the bytes of a Python standard-library source file, used as token ids (vocab 256).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

SEQ_LEN = 32


def text_tokens(n_sequences: int, seq_len: int = SEQ_LEN) -> torch.Tensor:
    """int64 [n_sequences, seq_len]: consecutive bytes of the stdlib's ``argparse.py``."""
    data = Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_bytes()[: n_sequences * seq_len]
    return torch.tensor(list(data), dtype=torch.long).view(n_sequences, seq_len)


class TextDataset(torch.utils.data.Dataset):
    """Causal-LM examples ``{"input_ids", "labels"}`` of real text, as HF models take them."""

    def __init__(self, n_sequences: int = 96) -> None:
        self.tokens = text_tokens(n_sequences)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def tiny_llama(seed: int = 0):
    """A 2-layer LlamaForCausalLM (hidden 64, intermediate 128, 4 heads, vocab 256), fp32, seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=256, max_position_embeddings=SEQ_LEN,
    )
    return LlamaForCausalLM(config)


def tolerance_ratio(actual: list[torch.Tensor], expected: list[torch.Tensor], rtol: float = 1e-6, atol: float = 1e-7) -> float:
    """max over tensors and elements of |a - e| / (atol + rtol |e|): <= 1 means within tolerance, 0 bitwise equal."""
    return max(((a.double() - e.double()).abs() / (atol + rtol * e.double().abs())).max().item() for a, e in zip(actual, expected))
