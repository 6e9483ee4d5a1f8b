"""Which implementation a launcher runs: the Triton kernel or the eager torch reference."""

from __future__ import annotations

import contextlib
import os

import torch
from torch import Tensor

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # e.g. macOS: only the torch reference is available
    HAS_TRITON = False

BACKENDS = ("auto", "triton", "torch")


def use_triton(backend: str, tensor: Tensor, name: str) -> bool:
    """Resolve ``backend`` for a call on ``tensor``: ``True`` for the Triton kernel.

    ``"auto"`` sends CUDA tensors to Triton and CPU tensors to the reference; ``"triton"`` on CPU
    tensors needs ``TRITON_INTERPRET=1`` (set before Triton is imported), which is how the tests
    run the kernels without a GPU.

    Raises:
        ValueError: an unknown ``backend``.
        RuntimeError: ``"triton"`` asked for but Triton is missing, or CPU tensors without
            ``TRITON_INTERPRET=1``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"{name}: backend={backend!r} must be one of {BACKENDS}")
    if backend == "torch" or (backend == "auto" and tensor.device.type != "cuda"):
        return False
    if not HAS_TRITON:
        raise RuntimeError(f"{name}: backend={backend!r} needs Triton, which is not installed")
    if tensor.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{name}: backend='triton' on {tensor.device.type} tensors runs only under TRITON_INTERPRET=1 (set before importing triton)")
    return True


def on_device(tensor: Tensor) -> contextlib.AbstractContextManager:
    """Make ``tensor``'s CUDA device current for a launch (a no-op off CUDA).

    Triton launches on the current CUDA device and its current stream, not on the arguments'
    device: with params on ``cuda:1`` while ``cuda:0`` is current (no ``torch.cuda.set_device``),
    the kernel would run on the wrong device and stream.
    """
    return torch.cuda.device(tensor.device) if tensor.device.type == "cuda" else contextlib.nullcontext()
