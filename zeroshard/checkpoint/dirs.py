"""Checkpoint directories on disk (``docs/checkpoint.md``, Crash safety): file reads only, no collective, so every rank raises alike."""

from __future__ import annotations

import io
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from zeroshard.checkpoint.whole_param import check_saved

METADATA = ".metadata"


def verify_checkpoint(checkpoint_id: str | os.PathLike, optimizer: Any = None, key: str = "optim") -> None:
    """Check that a DCP checkpoint directory is complete, every entry in it can be read, and (given ``optimizer``) that its
    optimizer state was saved for the same params, shapes, partition, dtype, buckets, masters, state and param group settings
    (:func:`~zeroshard.checkpoint.whole_param.check_saved`).

    Reads the whole checkpoint once (each entry is deserialized and dropped), so it costs about as much as a load.
    ``dcp.load`` refuses a param saved with another shape with DCP's own "Size mismatch" at the param's shape entry (see
    :func:`~zeroshard.checkpoint.sharded.param_shapes`); this names it first, in zeroshard's words, with no collective.

    Args:
        checkpoint_id: the directory given to ``dcp.save``.
        optimizer: a ``ShardedOptimizer`` about to load the checkpoint, or ``None``.
        key: the key the optimizer was saved under (``dcp.save({key: optimizer, ...})``).

    Raises:
        ValueError: naming the first bad file: ``.metadata`` missing (the save did not finish) or unreadable; a data file
            missing, shorter than its entries (truncated), or holding an entry that cannot be deserialized (corrupted); or,
            with ``optimizer``, no zeroshard optimizer state under ``key``, another format version or ``partition``, a param saved with
            another shape (named, with both shapes) or in another place of ``param_groups``, a param added or removed, another
            dtype or ``bucket_size_mb``, no fp32 masters where this optimizer keeps them, other optimizer state (another
            optimizer class, or hyperparameters that keep other state), or a param group saved without one of this
            optimizer's settings.
    """
    from torch.distributed.checkpoint import FileSystemReader  # on use: `import zeroshard` stays free of DCP (and sympy)

    path = Path(checkpoint_id)
    metadata_file = path / METADATA
    if not metadata_file.is_file():
        raise ValueError(f"{metadata_file} is missing: {path} is an incomplete checkpoint (its save did not finish) or not a checkpoint")
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as error:
        raise ValueError(f"{metadata_file} cannot be read ({error}): the checkpoint is corrupted") from error
    meta: dict[str, Any] = {}  # the saved optimizer's "zeroshard" entry
    entries = defaultdict(list)
    for index, info in metadata.storage_data.items():
        entries[info.relative_path].append((index, info))
    for name, items in sorted(entries.items()):
        file = path / name
        if not file.is_file():
            raise ValueError(f"{file} is missing from the checkpoint in {path}")
        size, needed = file.stat().st_size, max(info.offset + info.length for _, info in items)
        if size < needed:
            raise ValueError(f"{file} is truncated: it has {size} bytes, its entries need {needed}")
        with open(file, "rb") as stream:
            for index, info in sorted(items, key=lambda item: item[1].offset):
                if info.transform_descriptors:  # compressed or otherwise transformed: DCP decodes those
                    continue
                stream.seek(info.offset)
                try:
                    value = torch.load(io.BytesIO(stream.read(info.length)), map_location="cpu", weights_only=False)
                except Exception as error:
                    raise ValueError(f"{file} is corrupted: entry {index.fqn!r} at byte {info.offset} cannot be read ({error})") from error
                if index.fqn.startswith(f"{key}.zeroshard."):
                    meta[index.fqn.removeprefix(f"{key}.zeroshard.")] = value
    if optimizer is not None:
        if "layout" not in meta:
            raise ValueError(f"{path} holds no zeroshard optimizer state under {key!r} (no {key}.zeroshard.layout entry)")
        try:
            saved = {fqn.removeprefix(f"{key}."): tuple(getattr(entry, "size", ())) or None
                     for fqn, entry in metadata.state_dict_metadata.items() if fqn.startswith(f"{key}.")}
            check_saved(optimizer.checkpoint_view(), meta, saved)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None


def latest_checkpoint(parent: str | os.PathLike) -> Path | None:
    """The latest completed checkpoint directory directly under ``parent``, or ``None`` (directories without ``.metadata``,
    saves that did not finish, are skipped): the one whose name ends in the highest number when every name ends in one
    (``step_000010``, HF's ``checkpoint-10``: a copy or restore keeps it, not the files' times), else the one whose
    ``.metadata`` was written last."""
    root = Path(parent)
    if not root.is_dir():
        return None
    complete = [d for d in root.iterdir() if (d / METADATA).is_file()]
    numbers = {d: int(found.group(1)) for d in complete if (found := re.search(r"(\d+)$", d.name))}
    if complete and len(numbers) == len(complete):
        return max(complete, key=numbers.__getitem__)
    return max(complete, key=lambda d: (d / METADATA).stat().st_mtime_ns, default=None)
