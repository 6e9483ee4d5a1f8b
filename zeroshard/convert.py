"""A DCP checkpoint into one file, without a process group: ``python -m zeroshard.convert CKPT OUT`` (``docs/integrations.md``).

The checkpoint is read whole by DCP's no-process-group loader (every ``DTensor`` comes back full), and
the optimizer's sharded state is cut into per-param ``torch.optim`` state by the checkpoint's layout signature.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from zeroshard.checkpoint.dirs import METADATA, verify_checkpoint
from zeroshard.checkpoint.sharded import FULL_FORMAT, FULL_FORMAT_VERSION, SHARDED_FORMAT, _check_version
from zeroshard.compat import load_checkpoint_without_process_group
from zeroshard.layout.flat_buffer import param_name
from zeroshard.layout.partition import param_align, round_up
from zeroshard.step.wrapped import rebuild

__all__ = ["convert", "load_checkpoint", "main", "optimizer_to_torch"]


def load_checkpoint(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """Everything in the DCP checkpoint directory ``checkpoint``, as full tensors; no process group.

    Raises:
        ValueError: naming the file that is missing, truncated or corrupted (``.metadata`` or a data file), as
            :func:`zeroshard.verify_checkpoint` finds it.
    """
    if not (Path(checkpoint) / METADATA).is_file():
        verify_checkpoint(checkpoint)  # raises at once, naming the missing .metadata (before DCP logs its own tracebacks)
    state: dict[str, Any] = {}
    try:
        load_checkpoint_without_process_group(state, str(checkpoint))
    except (Exception, CheckpointException) as error:
        verify_checkpoint(checkpoint)  # names the bad file; reads the checkpoint only when the load failed
        raise ValueError(f"{checkpoint} cannot be read by torch.distributed.checkpoint: {error}") from error
    return state


def _with_subclasses(entry: dict[str, torch.Tensor], subclasses: dict[str, dict[str, Any]], source: str) -> dict[str, Any]:
    """A ``partition="param"`` entry's state (``master`` aside), tensor subclasses rebuilt as the checkpoint records them;
    ``ValueError`` if a recorded class cannot be imported (its package is not installed; named)."""
    state = {key: value.clone() for key, value in entry.items() if key != "master" and key.split(".", 1)[0] not in subclasses}
    for key, sub in subclasses.items():
        module, qualname = sub["cls"].split(":")
        try:
            cls: Any = importlib.import_module(module)
            for part in qualname.split("."):
                cls = getattr(cls, part)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"{source}: its state {key!r} is a {sub['cls']}, which cannot be imported here ({error}); install its package") from error
        inner = {name.split(".", 1)[1]: value.clone() for name, value in entry.items() if name.split(".", 1)[0] == key}
        state[key] = rebuild(cls, inner, sub["context"], sub["size"], sub["stride"])
    return state


def _sharded_meta(value: Any) -> dict[str, Any] | None:
    """The ``"zeroshard"`` entry of ``value`` if it is a zeroshard sharded optimizer state dict, else ``None``."""
    meta = value.get("zeroshard") if isinstance(value, dict) else None
    return meta if isinstance(meta, dict) and meta.get("format") == SHARDED_FORMAT else None


def optimizer_to_torch(sharded: dict[str, Any], source: str = "the state dict") -> dict[str, Any]:
    """A zeroshard sharded optimizer state dict with full tensors (as :func:`load_checkpoint` gives it) in ``torch.optim`` format.

    Each param's state is its run of every bucket tensor (from a multiple of 64 bytes into the bucket in format version 3,
    packed in version 2), reshaped to the param's shape and kept in the saved dtype
    (fp32 for 16-bit params), or with ``partition="param"`` its saved entry, whole; ``step`` (a 0-dim fp32 tensor, as
    ``torch.optim`` keeps it) comes from the per-param step counts and is written for each param group whose optimizer
    keeps one (``partition="param"`` records which; flat: every group but SGD's, which has ``dampening``). Params never
    stepped get no entry.

    Args:
        sharded: the ``"optim"`` entry of a loaded checkpoint.
        source: what errors call the checkpoint (its path).

    Raises:
        ValueError: ``sharded`` is not a zeroshard sharded state dict of a version this zeroshard reads, or a bucket's
            size does not match its params' shapes (both named).
    """
    meta = _sharded_meta(sharded)
    if meta is None:
        found = sorted(sharded) if isinstance(sharded, dict) else type(sharded).__name__
        raise ValueError(f"{source}: the optimizer entry is not a zeroshard sharded state dict (found {found})")
    try:
        _check_version(meta)  # every version this zeroshard reads: both flat layouts are cut here
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from error
    groups = sharded["param_groups"]
    steps = [int(s) for s in sharded["param_steps"].tolist()]
    state: dict[int, dict[str, Any]] = {}
    masters: dict[int, torch.Tensor] = {}
    # whether each group's optimizer keeps step: recorded with partition="param"; flat: every optimizer but SGD (a group with dampening)
    keeps = meta.get("keeps_step") or ["dampening" not in group for group in groups]
    keeps_step = {index: keep for group, keep in zip(groups, keeps) for index in group["params"]}
    if meta.get("partition") == "param":  # each param's state whole, keyed by its index (zeroshard/checkpoint/whole_param.py); none: no state
        for name, entry in sorted((sharded.get("params") or {}).items(), key=lambda item: int(item[0])):
            index = int(name)
            if "master" in entry:
                masters[index] = entry["master"].clone()
            if steps[index]:
                state[index] = {**({"step": torch.tensor(float(steps[index]))} if keeps_step[index] else {}),
                                **_with_subclasses(entry, (meta.get("subclasses") or {}).get(name, {}), source)}
    place = {param_name(g, j): index for g, group in enumerate(groups) for j, index in enumerate(group["params"])}
    for k, (dtype, params, per_bucket) in enumerate(meta["layout"] if meta.get("partition") != "param" else []):
        align = param_align(getattr(torch, dtype.removeprefix("torch.")).itemsize) if meta["version"] > 2 else 1
        first = 0
        for b, count in enumerate(per_bucket):
            name_of_bucket = f"{k}.{b}"
            entry = sharded["buckets"].get(name_of_bucket, {})  # none when the optimizer keeps no per-element state
            offset = 0
            for name, shape in params[first : first + count]:
                if name not in place:
                    raise ValueError(f"{source}: its layout names a param {name!r}, not one of its param_groups[g]['params'][j]")
                index, numel = place[name], math.prod(shape)
                offset = round_up(offset, align)
                for key, value in entry.items():
                    if value.numel() < offset + numel:
                        raise ValueError(f"{source}: bucket {name_of_bucket} {key!r} has {value.numel()} elements, too few for its params ({name} "
                                         f"{tuple(shape)})")
                    piece = value[offset : offset + numel].clone().view(tuple(shape))
                    if key == "master":
                        masters[index] = piece
                    elif steps[index]:
                        state.setdefault(index, {})[key] = piece
                if steps[index] and keeps_step[index]:
                    state.setdefault(index, {})["step"] = torch.tensor(float(steps[index]))
                offset += numel
            first += count
    return {
        "state": dict(sorted(state.items())),
        "param_groups": groups,
        "zeroshard": {"format": FULL_FORMAT, "version": FULL_FORMAT_VERSION, "master": masters, "loss_scaler": meta.get("loss_scaler")},
    }


def convert(checkpoint: str | os.PathLike, out: str | os.PathLike, *, model_key: str = "model", optim_key: str | None = None) -> None:
    """Write the DCP checkpoint ``checkpoint`` to the single file ``out`` (see ``docs/integrations.md``).

    Args:
        checkpoint: the directory given to ``dcp.save``.
        out: the file to write: ``*.safetensors`` for the model's tensors, else ``torch.save``, with the optimizer state in
            ``torch.optim`` format.
        model_key: the key the model state dict was saved under (``dcp.save({model_key: model.state_dict(), ...})``).
        optim_key: the key of the ``ShardedOptimizer`` to convert (``dcp.save({optim_key: opt, ...})``; other entries are
            written as loaded), or ``None``: every top-level entry that holds one's state (``dcp.save({"enc": opt1, "dec": opt2})``).

    Raises:
        ValueError: ``checkpoint`` or ``out``'s directory does not exist; a bad checkpoint file (named); no ``optim_key``
            entry, or no optimizer entry at all (``torch.save`` output), or no ``model_key`` entry (safetensors output) in it,
            naming the keys found.
        ModuleNotFoundError: safetensors output without the ``safetensors`` package (the ``integrations`` extra).
    """
    for path, what in ((Path(checkpoint), "the checkpoint directory"), (Path(out).parent, f"the directory of {out}")):
        if not path.is_dir():
            raise ValueError(f"{path}: {what} {'is a file' if path.exists() else 'does not exist'}")
    state = load_checkpoint(checkpoint)
    if str(out).endswith(".safetensors"):
        if model_key not in state:
            raise ValueError(f"{checkpoint} has no {model_key!r} entry to write to {out} (it has {sorted(state)}); pass --model-key")
        try:
            from safetensors.torch import save_file  # optional: only this output needs it
        except ModuleNotFoundError as error:
            raise ModuleNotFoundError(f"writing {out} needs safetensors: pip install 'zeroshard[integrations]' ({error})") from error

        tensors = {k: v.contiguous() for k, v in state[model_key].items() if torch.is_tensor(v)}
        save_file(tensors, str(out), metadata={"format": "pt"})
        return
    if optim_key is not None and optim_key not in state:
        raise ValueError(f"{checkpoint} has no {optim_key!r} entry (it has {sorted(state)}); pass --optim-key")
    keys = [optim_key] if optim_key is not None else [key for key, value in state.items() if _sharded_meta(value) is not None]
    if not keys:
        raise ValueError(f"{checkpoint} holds no ShardedOptimizer's state (it has {sorted(state)}); write OUT.safetensors for the model alone")
    for key in keys:
        state[key] = optimizer_to_torch(state[key], f"{checkpoint} ({key!r})")
    torch.save(state, out)


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
    parser.add_argument("--optim-key", help="the key of the ShardedOptimizer to convert (default: every one in the checkpoint)")
    args = parser.parse_args(argv)
    try:
        convert(args.checkpoint, args.out, model_key=args.model_key, optim_key=args.optim_key)
    except (ValueError, ImportError, OSError) as error:
        print(f"python -m zeroshard.convert: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
