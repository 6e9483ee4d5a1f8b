"""Run with 2 ranks under torch.distributed.run (the process group keeps torch's 30-minute default
timeout): a rank left alone in a collective raises within ``collective_timeout_s``. Each case has its
own 2-rank subgroup, made up front (a timed-out gloo group is unusable afterwards; the others are not),
and its own model and optimizer with ``collective_timeout_s=2``; both ranks run a backward on every
model. Then, case by case, rank 0 calls ``step()`` (``step``), ``consolidate_state_dict()``
(``consolidate``), reads a param's gradient norm (``norm``) or adds a param group (``add_param_group``)
and rank 1 does not, or rank 0 unfreezes a param before both call ``step()`` (``unfreeze``): rank 0 prints
``<case> raised: <message>`` and writes ``argv[1]/<case>`` so that rank 1, which waits for that file,
goes on to the next case. Neither rank destroys a process group."""

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

CASES = ("step", "consolidate", "norm", "add_param_group", "unfreeze")


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]) for _ in CASES]
    models = [TinyNet() for _ in CASES]

    def build(model, group):
        return zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), process_group=group, collective_timeout_s=2.0)

    opts = [build(model, group) for model, group in zip(models, groups)]
    for model in models:
        loss_fn(model, *batch(rank, 0)).backward()
    for case, model, opt in zip(CASES, models, opts):
        if rank == 0:
            try:
                if case == "step":
                    opt.step()
                elif case == "consolidate":
                    opt.consolidate_state_dict()
                elif case == "norm":
                    model.fc1.weight.grad.norm().item()
                elif case == "add_param_group":
                    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})
                else:  # rank 0 unfroze a param, rank 1 did not: both step (gloo must not abort either process)
                    model.frozen_scale.requires_grad_(True)
                    opt.step()
            except RuntimeError as error:
                print(f"{case} raised: {error}", flush=True)
            else:
                print(f"{case} returned without rank 1", flush=True)
            (out / case).touch()
        else:
            if case == "unfreeze":
                try:
                    opt.step()
                except RuntimeError as error:
                    print(f"{case}-rank-1 raised: {error}", flush=True)
            deadline = time.monotonic() + 60
            while not (out / case).exists() and time.monotonic() < deadline:
                time.sleep(0.1)
    sys.stdout.flush()
    os._exit(0)  # the timed-out groups are unusable: no destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
