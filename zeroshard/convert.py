"""The command line ``python -m zeroshard.convert CKPT OUT``; also exports :mod:`zeroshard.checkpoint.convert`'s functions."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zeroshard.checkpoint.convert import convert, load_checkpoint, optimizer_to_torch

__all__ = ["convert", "load_checkpoint", "main", "optimizer_to_torch"]


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (0, or 1 with the error on stderr)."""
    parser = argparse.ArgumentParser(
        prog="python -m zeroshard.convert",
        description=(
            "Convert a torch.distributed.checkpoint (DCP) directory saved with dcp.save({'model': model.state_dict(), 'optim': opt}) "
            "into one file, without a process group. OUT.safetensors: the model's tensors. Any other OUT: torch.save of the whole "
            "checkpoint with the optimizer in plain torch.optim format (per-param exp_avg, exp_avg_sq, step keyed by param index), "
            "which torch.optim.AdamW(model.parameters()).load_state_dict(torch.load(OUT)['optim']) loads on one process."
        ),
    )
    parser.add_argument("checkpoint", metavar="CKPT", type=Path, help="the DCP checkpoint directory (what dcp.save's checkpoint_id named)")
    parser.add_argument("out", metavar="OUT", type=Path, help="the file to write (.safetensors: model weights only; else torch.save)")
    parser.add_argument("--model-key", default="model", help="the key the model state dict was saved under (default: model)")
    parser.add_argument("--optim-key", default="optim", help="the key the ShardedOptimizer was saved under (default: optim)")
    args = parser.parse_args(argv)
    try:
        convert(args.checkpoint, args.out, model_key=args.model_key, optim_key=args.optim_key)
    except (ValueError, ImportError, OSError) as error:
        print(f"python -m zeroshard.convert: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
