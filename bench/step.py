"""``step`` suite: one training step (forward, backward, optimizer step) of the example GPT at 2 ranks.

zeroshard stages 1 and 2 against DDP + AdamW, ``ZeroRedundancyOptimizer(AdamW)`` + DDP and FSDP2
``fully_shard(reshard_after_forward=False)`` + AdamW: same model, batch and dtype, same AdamW
settings, at two model sizes (the example GPT and one 8 layers x 512 wide on CPU) in fp32 and in
bf16 (params and gradients in bf16 for every method; zeroshard keeps fp32 masters, the others
none). When DeepSpeed is installed (the ``bench`` extra), its ZeRO stages 1 and 2 join as baselines:
``deepspeed.initialize`` over the same model with the same ``torch.optim.AdamW`` as client
optimizer, no clipping, on the default process group (on CPU with ``DS_ACCELERATOR=cpu``, over
gloo). Methods take turns in short rounds (2-3 timed steps after an untimed one, see
:func:`time_steps`), in reverse order every other round, so drift in the machine's speed and the
state one method leaves the next (caches, the allocator) hit all alike; each figure is the
median step time over all rounds, and each ratio is against a baseline measured in the same run.

The suite also counts the bytes each rank sends per step at world size 4 for DDP, flat sharding
(shard size 4) and hybrid sharding (``zeroshard.hybrid_mesh(2)``): the growth of the process's
``wchar`` in ``/proc/self/io``, which counts every byte written to the collectives' sockets (only
collectives write during a step). Counted, not estimated; Linux and CPU ranks only (NCCL moves its
bytes without write calls).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard
from bench import gpt
from bench.harness import RATIO_LEGEND, Table, Timing, progress, ratio, run_ranks

DEEPSPEED = ("deepspeed_stage1", "deepspeed_stage2")  # timed when deepspeed is importable
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
METHODS = ("ddp", "torch_zero", "fsdp2", "zeroshard_stage1", "zeroshard_stage2") + (DEEPSPEED if HAS_DEEPSPEED else ())
RATIOS = (
    ("zeroshard_stage2", "ddp"),
    ("zeroshard_stage2", "torch_zero"),
    ("zeroshard_stage2", "fsdp2"),
    ("zeroshard_stage1", "ddp"),
) + ((("zeroshard_stage1", "deepspeed_stage1"), ("zeroshard_stage2", "deepspeed_stage2"), ("deepspeed_stage2", "ddp")) if HAS_DEEPSPEED else ())
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95)}
SUMMARY = "training step of the example GPT at 2 ranks vs DDP, torch ZeRO, FSDP2; bytes sent"
TABLES = (
    Table(("time", "ratio"), "median_ms, p20_ms, p80_ms: one training step, over all rounds; tokens_per_s: both ranks' tokens / median; "
                             f"{RATIO_LEGEND}"),
    Table(("bytes",), "bytes_sent_per_rank_MiB: what one rank writes to the collectives per training step at world size 4 (the busiest "
                      "rank's median; zeroshard at stage 2); bytes_per_param: that / params; vs_flat: that / zeroshard_flat's"),
)


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def build_method(method: str, config: gpt.GPTConfig, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> tuple[nn.Module, torch.optim.Optimizer]:
    """(model to call, optimizer) for one method, from the same initial weights, params in ``dtype``."""
    model = gpt.build(config, device).to(dtype)
    if method == "ddp":
        return DDP(model), torch.optim.AdamW(gpt.decay_groups(model), **ADAMW)
    if method == "torch_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(gpt.decay_groups(model), optimizer_class=torch.optim.AdamW, **ADAMW)
        return DDP(model), opt
    if method == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        fully_shard = _fully_shard()
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        return model, torch.optim.AdamW(gpt.decay_groups(model), **ADAMW)
    if method in DEEPSPEED:
        return deepspeed_method(model, int(method[-1]), dtype)
    stage = {"zeroshard_stage1": 1, "zeroshard_stage2": 2}[method]
    # A process group of its own: ShardedOptimizers that share one take turns, and each backward
    # also reduces the others' buckets with zeros (zeroshard/reduce/coordinator.py), which would time
    # both methods' reductions in every step of either.
    return model, zeroshard.ShardedOptimizer(torch.optim.AdamW(gpt.decay_groups(model), **ADAMW), stage=stage, process_group=dist.new_group())


class DeepSpeedStep:
    """A DeepSpeed engine behind the calls the suite makes of a method, ``model(x, y).backward(); opt.step(); opt.zero_grad()``:
    model and optimizer both, the loss's ``backward()`` going through ``engine.backward`` (which reduces the gradients)."""

    def __init__(self, engine: nn.Module) -> None:
        self.engine = engine

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> DeepSpeedStep._Loss:
        return DeepSpeedStep._Loss(self.engine, self.engine(x, y))

    def step(self) -> None:
        self.engine.step()  # zeroes the gradients too

    def zero_grad(self) -> None:
        pass

    class _Loss:
        def __init__(self, engine: nn.Module, loss: torch.Tensor) -> None:
            self.engine, self.loss = engine, loss

        def backward(self) -> None:
            self.engine.backward(self.loss)


def deepspeed_method(model: nn.Module, stage: int, dtype: torch.dtype) -> tuple[DeepSpeedStep, DeepSpeedStep]:
    """DeepSpeed ZeRO ``stage`` (1 or 2) over ``model`` with ``torch.optim.AdamW`` as its client optimizer, as (model, optimizer)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its INFO lines would break the suite's output into pieces
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == torch.bfloat16},
              "gradient_clipping": 0.0, "steps_per_print": 1 << 30, "wall_clock_breakdown": False}
    with contextlib.redirect_stdout(io.StringIO()):  # and so would its op builder's prints (the CPU shared-memory comm op)
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(gpt.decay_groups(model), **ADAMW), config=config,
                                          dist_init_required=False)
    wrapped = DeepSpeedStep(engine)
    return wrapped, wrapped


def _sync(device: torch.device) -> None:
    """Wait for the work queued on the current CUDA stream (not the communication streams: an
    all-gather left in flight stays in flight)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def time_steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, steps: int, device: torch.device) -> list[float]:
    """Seconds per step for ``steps`` consecutive steps in steady state, started together on all ranks (one barrier).

    One untimed step leads: its forward finds nothing in flight. Each timed step then pays what
    the step before it left in flight (zeroshard's overlapped param all-gather, waited for by the
    forward), as in training, and leaves its own for the next. After the last, the gathers are
    waited for untimed (``wait_params``), so nothing is in flight when another method runs.
    """
    _sync(device)
    dist.barrier()
    marks = []
    for _ in range(steps + 1):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        _sync(device)
        marks.append(time.perf_counter())
    if hasattr(opt, "wait_params"):
        opt.wait_params()
    return [b - a for a, b in zip(marks, marks[1:])]


def time_rounds(built: dict[str, tuple[nn.Module, torch.optim.Optimizer]], x: torch.Tensor, y: torch.Tensor, rounds: int, steps: int,
                warmup: int, device: torch.device) -> dict[str, list[float]]:
    """Seconds per step of each method in ``built``: ``warmup`` untimed steps each, then ``rounds`` rounds of
    ``steps`` timed steps per method (:func:`time_steps`), the methods in reverse order every other round."""
    for model, opt in built.values():
        time_steps(model, opt, x, y, warmup, device)
    methods = tuple(built)
    samples: dict[str, list[float]] = {m: [] for m in methods}
    for round_ in range(rounds):
        for method in methods if round_ % 2 == 0 else methods[::-1]:  # each method follows each neighbour equally often
            model, opt = built[method]
            samples[method] += time_steps(model, opt, x, y, steps, device)
    return samples


def rank_main(config: gpt.GPTConfig, dtype: torch.dtype, rounds: int, steps: int, warmup: int) -> dict[str, list[float]]:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    x, y = gpt.batch(config, dist.get_rank(), device)
    built = {m: build_method(m, config, device, dtype) for m in METHODS}
    return time_rounds(built, x, y, rounds, steps, warmup, device)


def settings(quick: bool) -> list[tuple[gpt.GPTConfig, torch.dtype, int, int, int]]:
    """(model, dtype, rounds, steps per round, warm-up steps) for each timed setting."""
    if quick:
        return [(gpt.QUICK, torch.float32, 2, 1, 1)]
    small, large = (gpt.FULL_GPU, gpt.LARGE_GPU) if torch.cuda.is_available() else (gpt.FULL_CPU, gpt.LARGE_CPU)
    return [(small, torch.float32, 16, 3, 3), (small, torch.bfloat16, 10, 3, 2), (large, torch.float32, 6, 2, 1),
            (large, torch.bfloat16, 5, 2, 1)]


def run(quick: bool) -> list[dict]:
    """Time every method at world size 2 per setting: a row per method, a row per ratio; then one row per layout's bytes."""
    rows: list[dict] = []
    for config, dtype, rounds, steps, warmup in settings(quick):
        name = str(dtype).removeprefix("torch.").replace("float32", "fp32").replace("bfloat16", "bf16")
        progress("step", f"timing {len(METHODS)} methods at 2 ranks in {name}, {rounds} rounds x {steps} steps each ({config})")
        samples = run_ranks(rank_main, 2, config, dtype, rounds, steps, warmup)[0]
        timings = {m: Timing(m, tuple(s)) for m, s in samples.items()}
        tokens = config.batch_size * config.seq_len * 2
        model = f"{config.n_layer}x{config.n_embd}"
        rows += [
            {"kind": "time", "model": model, "dtype": name, "method": m, "baseline": "", "median_ms": t.median * 1e3, "p20_ms": t.p20 * 1e3,
             "p80_ms": t.p80 * 1e3, "tokens_per_s": tokens / t.median, "ratio": ""}
            for m, t in timings.items()
        ]
        rows += [
            {"kind": "ratio", "model": model, "dtype": name, "method": a, "baseline": b, "median_ms": "", "p20_ms": "", "p80_ms": "",
             "tokens_per_s": "", "ratio": ratio(timings[a], timings[b])}
            for a, b in RATIOS
        ]
    config = gpt.QUICK if quick else (gpt.FULL_GPU if torch.cuda.is_available() else gpt.FULL_CPU)
    progress("step", f"counting bytes sent per rank per step at world size 4 ({', '.join(name for name, _ in COMM_LAYOUTS)})")
    return rows + comm_rows(config, steps=1 if quick else 5)


COMM_LAYOUTS = (("ddp", None), ("zeroshard_flat", 4), ("zeroshard_hybrid", 2))  # (name, shard size)
PROC_IO = Path("/proc/self/io")


def bytes_written() -> int:
    """This process's ``wchar``: bytes passed to write calls so far, sockets included (Linux)."""
    for line in PROC_IO.read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError(f"{PROC_IO} has no wchar line")


def comm_rank_main(config: gpt.GPTConfig, steps: int) -> dict[str, list[int]]:
    """Bytes written by this rank in each of ``steps`` training steps, per layout (stage 2 for zeroshard)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    x, y = gpt.batch(config, dist.get_rank(), device)
    sent: dict[str, list[int]] = {}
    for name, shard_size in COMM_LAYOUTS:
        if shard_size is None:
            model, opt = build_method("ddp", config, device)
        else:
            model = gpt.build(config, device)
            group = zeroshard.hybrid_mesh(shard_size) if shard_size < dist.get_world_size() else None
            opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(gpt.decay_groups(model), **ADAMW), stage=2, process_group=group)
        sent[name] = []
        for step in range(steps + 1):
            _sync(device)
            dist.barrier()
            before = bytes_written()
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            if isinstance(opt, zeroshard.ShardedOptimizer):
                opt.wait_params()  # its all-gather's bytes in this step's count
            _sync(device)
            if step:  # the first step builds buckets and state
                sent[name].append(bytes_written() - before)
    return sent


def comm_rows(config: gpt.GPTConfig, steps: int) -> list[dict]:
    """One row per layout: the largest per-rank median of bytes sent per step, and that over flat sharding's.

    None on CUDA (NCCL moves bytes without write calls) or without ``/proc/self/io``.
    """
    if not PROC_IO.exists() or torch.cuda.is_available():
        return []
    per_rank = run_ranks(comm_rank_main, 4, config, steps)
    numel = sum(p.numel() for p in gpt.build(config, torch.device("cpu")).parameters())
    sent = {name: max(statistics.median(rank[name]) for rank in per_rank) for name, _ in COMM_LAYOUTS}
    return [
        {"kind": "bytes", "method": name, "world_size": 4, "shard_size": shard or "",
         "bytes_sent_per_rank_MiB": sent[name] / 2**20, "bytes_per_param": sent[name] / numel, "vs_flat": sent[name] / sent["zeroshard_flat"]}
        for name, shard in COMM_LAYOUTS
    ]
