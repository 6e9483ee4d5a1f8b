"""Run with 2 ranks under torch.distributed.run (the process group keeps torch's 30-minute default
timeout): both ranks run a backward, then rank 0 calls ``step()`` (or, with ``norm`` as the second
argument, reads a param's gradient norm; with ``consolidate``, calls ``consolidate_state_dict()``) and rank 1 does not. With
``collective_timeout_s=2`` rank 0 must raise a clear error naming the collective within the bound;
it prints ``timeout raised: <message>``, then writes ``argv[1]/raised`` so that rank 1, which
waits for that file, exits. Neither rank destroys the process group (it is unusable afterwards)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from models import TinyNet, batch, loss_fn, param_groups

import zeroshard


def main(out: Path, what: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), collective_timeout_s=2.0)
    loss_fn(model, *batch(rank, 0)).backward()
    if rank == 0:
        try:
            if what == "step":
                opt.step()
            elif what == "consolidate":
                opt.consolidate_state_dict()
            else:
                model.fc1.weight.grad.norm().item()
        except RuntimeError as error:
            print(f"timeout raised: {error}", flush=True)
        else:
            print(f"{what} returned without rank 1", flush=True)
        (out / "raised").touch()
    else:
        deadline = time.monotonic() + 60
        while not (out / "raised").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    sys.stdout.flush()
    os._exit(0)  # the process group is unusable: no destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "step")
