"""Run with 2 ranks under torch.distributed.run with NumPy made unimportable (the parent test puts a
``numpy`` package that raises on import first on ``PYTHONPATH``): build the optimizer, step, save
its state per rank and consolidated, load both into fresh optimizers and check they continue
exactly as the original does. Prints ``no-numpy ok`` on rank 0."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from models import TinyNet, batch, loss_fn, param_groups

import zeroshard


def train(model, opt, steps) -> None:
    for step in steps:
        loss_fn(model, *batch(dist.get_rank(), step)).backward()
        opt.step()
        opt.zero_grad()


def main(out: Path) -> None:
    try:
        import numpy  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("numpy is importable: the parent test must block it")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyNet()
    # Both copies are taken before wrapping: the wrapper makes the params views of its buffers.
    resumed_models = [copy.deepcopy(model), copy.deepcopy(model)]
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), stage=2, max_grad_norm=1.0)
    train(model, opt, range(3))

    torch.save(opt.state_dict(), out / f"shard_{rank}.pt")
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save(opt.state_dict(), out / "full.pt")
    dist.barrier()

    resumed = []
    for resumed_model, path in zip(resumed_models, (out / f"shard_{rank}.pt", out / "full.pt")):
        with torch.no_grad():
            for target, source in zip(resumed_model.parameters(), model.parameters()):
                target.copy_(source)
        resumed_opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(resumed_model), lr=1e-2), stage=2, max_grad_norm=1.0)
        resumed_opt.load_state_dict(torch.load(path, weights_only=False))
        resumed.append((resumed_model, resumed_opt))
    train(model, opt, range(3, 6))
    for resumed_model, resumed_opt in resumed:
        train(resumed_model, resumed_opt, range(3, 6))
        for a, b in zip(model.parameters(), resumed_model.parameters()):
            assert torch.equal(a, b), "a resumed run differs from the uninterrupted one"
    if rank == 0:
        print("no-numpy ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
