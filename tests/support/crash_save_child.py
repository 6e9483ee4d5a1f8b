"""Run with 2 ranks under torch.distributed.run: save step_2 completely, then start saving step_4
and stall after the data files, before .metadata (where the parent test SIGKILLs every rank)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

sys.path.insert(0, str(Path(__file__).parent))
from models import TinyNet, batch, loss_fn, param_groups

import zeroshard


class StallBeforeMetadata(FileSystemWriter):
    """Writes the data files, then announces itself and hangs where .metadata would be written."""

    def __init__(self, path: str, marker: Path) -> None:
        super().__init__(path)
        self.marker = marker

    def finish(self, metadata, results) -> None:
        # Stall until torchrun (this worker's parent) is killed, then go too: torchrun starts its
        # workers in sessions of their own, which the parent's kill of its process group misses.
        agent, deadline = os.getppid(), time.monotonic() + 600
        self.marker.touch()
        while os.getppid() == agent and time.monotonic() < deadline:
            time.sleep(0.1)
        os._exit(1)


def main() -> None:
    parent, marker = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), bucket_size_mb=100 * 4 / 2**20)
    for step in range(4):
        loss_fn(model, *batch(dist.get_rank(), step)).backward()
        opt.step()
        model.zero_grad()
        if step == 1:
            dcp.save({"model": model.state_dict(), "optim": opt}, checkpoint_id=parent / "step_2")
    dcp.save({"model": model.state_dict(), "optim": opt}, storage_writer=StallBeforeMetadata(str(parent / "step_4"), marker))


if __name__ == "__main__":
    main()
