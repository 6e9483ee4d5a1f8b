"""ShardedOptimizer against DDP + torch.optim.AdamW(foreach=False) on gloo ranks.

Every config trains 20+ steps with two param groups, a LambdaLR schedule, odd param sizes, tied
weights, a frozen param, several buckets, and compares all params after every step.
"""

from __future__ import annotations

import contextlib
import copy
import itertools

import pytest
import torch
import torch.distributed as dist
from models import TinyNet, batch, loss_fn, param_groups, relative_error, tolerance_ratio
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard

STEPS = 20
MICRO = 2


def _schedule(step: int) -> float:
    return 1.0 / (1.0 + 0.1 * step)


def _branch_used(rank: int, step: int) -> bool:
    """Steps 3-5: the branch is unused on every rank; steps 8-10: unused on rank 0 only."""
    return not (3 <= step <= 5 or (8 <= step <= 10 and rank == 0))


def _train_pair(stage: int, accumulation: str, overlap_comm: bool, dtype: torch.dtype = torch.float32, add_group_at: int | None = None,
                reduce_dtype: torch.dtype | None = None, process_group=None, ddp_group=None, max_grad_norm: float | None = None,
                clip_api: bool = False, optimizer_class=torch.optim.AdamW, offload: str | None = None, ddp_hook=None, steps: int = STEPS):
    """Train DDP + AdamW and ShardedOptimizer(AdamW) side by side; yield after every step.

    ``process_group`` is what ShardedOptimizer shards over; ``ddp_group`` the group of the DDP
    reference (default: the world). With ``max_grad_norm`` the reference clips with
    ``torch.nn.utils.clip_grad_norm_`` and ShardedOptimizer clips through its constructor argument,
    or through ``clip_grad_norm_`` every step when ``clip_api``.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref_model = TinyNet().to(dtype)
    model = copy.deepcopy(ref_model)
    groups = param_groups(ref_model)
    held_back = groups.pop() if add_group_at is not None else None

    ref = DDP(ref_model, find_unused_parameters=True, process_group=ddp_group) if world > 1 else ref_model
    if ddp_hook is not None:
        ref.register_comm_hook(None, ddp_hook)
    extra = {"foreach": False} if optimizer_class is torch.optim.AdamW else {"momentum": 0.9}
    ref_opt = optimizer_class(groups, lr=1e-2, **extra)
    # torch's LR schedulers do not follow groups added later, so that config runs without one.
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, _schedule) if add_group_at is None else None

    zgroups = param_groups(model)
    if add_group_at is not None:
        zgroups.pop()
    opt = zeroshard.ShardedOptimizer(
        optimizer_class(zgroups, lr=1e-2, **extra), stage=stage, bucket_size_mb=200 * 4 / 2**20, overlap_comm=overlap_comm,
        reduce_dtype=reduce_dtype, process_group=process_group, max_grad_norm=None if clip_api else max_grad_norm, offload=offload,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule) if add_group_at is None else None

    for step in range(steps):
        if step == add_group_at:
            ref_opt.add_param_group({**held_back, "lr": 1e-2 * _schedule(step)})
            opt.add_param_group({"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": 1e-2 * _schedule(step)})
        micro = MICRO if accumulation != "none" else 1
        use_branch = _branch_used(rank, step)
        for m in range(micro):
            last = m == micro - 1
            x, y = batch(rank, step, m)
            ref_ctx = ref.no_sync() if (accumulation == "no_sync" and not last and world > 1) else contextlib.nullcontext()
            with ref_ctx:
                (loss_fn(ref, x, y, use_branch) / micro).backward()
            ctx = opt.no_sync() if (accumulation == "no_sync" and not last) else contextlib.nullcontext()
            with ctx:
                (loss_fn(model, x, y, use_branch) / micro).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_grad_norm)
            if clip_api:
                opt.clip_grad_norm_(max_grad_norm)
        ref_opt.step()
        ref_model.zero_grad()  # also the params of a group not added yet
        opt.step()
        for scheduler in (ref_sched, sched) if add_group_at is None else ():
            scheduler.step()
        # HF Trainer only ever calls model.zero_grad(); alternate with the optimizer's own (which,
        # like torch's, leaves alone params of a group not added yet).
        (model.zero_grad if step % 2 or add_group_at is not None else opt.zero_grad)()
        yield ref_model, model, opt


def parity_worker(configs: list[tuple]) -> list[tuple]:
    """For each config, the worst tolerance ratio over all steps and whether every step was bitwise equal."""
    out = []
    for config in configs:
        worst, bitwise = 0.0, True
        for ref_model, model, _ in _train_pair(*config):
            worst = max(worst, tolerance_ratio(model, ref_model))
            bitwise &= all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
        identical = _same_on_all_ranks(model)
        out.append((config, worst, bitwise, identical))
    return out


def _same_on_all_ranks(model, group=None) -> bool:
    flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    return all(torch.equal(g, flat) for g in gathered)


CONFIGS = [
    (stage, accumulation, overlap)
    for stage, accumulation, overlap in itertools.product((1, 2), ("none", "backward", "no_sync"), (True, False))
    if overlap or accumulation == "backward"
]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_parity_with_ddp_adamw(pools, world_size):
    results = pools[world_size].run(parity_worker, CONFIGS)
    for config, worst, bitwise, identical in results[0]:
        assert identical, f"{config}: params differ between ranks"
        assert worst <= 1.0, f"{config}: params off DDP + AdamW by {worst:.3g}x the tolerance (rtol 1e-6, atol 1e-7)"
        if world_size == 1 or (world_size == 2 and config[1] != "backward"):  # DDP sums micro-batches in .grad, zeroshard per reduction
            assert bitwise, f"{config}: not bitwise equal to {'DDP + ' * (world_size > 1)}AdamW(foreach=False) at world size {world_size}"


def odd_sizes_worker(stage: int, partition: str, spectral: bool) -> list[int]:
    """The steps (of 8) after which a model whose params are not whole 64-byte lines (a bias of 1 element, first in the buffer;
    with ``spectral``, a ``spectral_norm`` weight of 8 x 13) differs from DDP + AdamW in any bit: its params start on 64-byte
    boundaries in the flat buffer, as outside it, so that CPU matmul and ``mv`` kernels, whose rounding depends on the
    address, see them as DDP's do."""
    torch.manual_seed(0)
    hidden = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(8, 13)) if spectral else torch.nn.Linear(8, 16)
    ref_model = torch.nn.Sequential(hidden, torch.nn.Tanh(), torch.nn.Linear(hidden.out_features, 1))
    model = copy.deepcopy(ref_model)
    ref, ref_opt = DDP(ref_model), torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False), stage=stage, partition=partition)
    differ = []
    for step in range(8):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        for m, o in ((ref, ref_opt), (model, opt)):
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
        if not all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters())):
            differ.append(step)
    return differ


@pytest.mark.parametrize("spectral", [False, True])
@pytest.mark.parametrize("partition", ["flat", "param"])
def test_params_of_any_size_train_bitwise_as_ddp_at_two_ranks(pools, partition, spectral):
    for stage in (1, 2):
        assert pools[2].run(odd_sizes_worker, stage, partition, spectral) == [[], []], (stage, partition)


def test_add_param_group_matches_torch(pools):
    results = pools[2].run(parity_worker, [(stage, "none", True, torch.float32, 7) for stage in (1, 2)])
    for config, worst, _, identical in results[0]:
        assert identical and worst <= 1.0, f"{config}: tolerance ratio {worst:.3g}"


def fp64_worker(configs: list[tuple]) -> list[tuple[float, list[torch.dtype]]]:
    """Per (stage, offload, max_grad_norm, clip_api): the worst tolerance ratio against DDP + AdamW in fp64, at fp64's
    tolerance, and the dtypes of the norms zeroshard returned (``opt.grad_norm``; with ``clip_api``, ``clip_grad_norm_``'s)."""
    out = []
    for stage, offload, max_grad_norm, clip_api in configs:
        worst, dtypes = 0.0, []
        for ref_model, model, opt in _train_pair(stage, "backward", True, torch.float64, offload=offload, max_grad_norm=max_grad_norm,
                                                 clip_api=clip_api, steps=6):
            worst = max(worst, tolerance_ratio(model, ref_model, rtol=1e-12, atol=1e-14))
            dtypes.append(opt.grad_norm.dtype)
        if clip_api:  # one more backward: the value clip_grad_norm_ returns
            loss_fn(model, *batch(dist.get_rank(), 0)).backward()
            dtypes.append(opt.clip_grad_norm_(1.0).dtype)
            opt.zero_grad()
        out.append((worst, dtypes))
    return out


def test_fp64_params_train_like_ddp_to_fp64_precision(pools):
    # The norm, the clip coefficient and the update stay in fp64 (grad_sumsq and the CPU kernels' grad_scale read fp32),
    # and so do the norms returned, as torch.nn.utils.clip_grad_norm_ returns an fp64 model's.
    configs = [(1, None, None, False), (2, None, 0.5, True), (1, "cpu", 0.5, True), (2, "cpu", None, False)]
    for config, (worst, dtypes) in zip(configs, pools[2].run(fp64_worker, configs)[0]):
        assert worst <= 1.0, f"(stage, offload, max_grad_norm, clip_api)={config}: params off DDP by {worst:.3g}x rtol 1e-12"
        assert set(dtypes) == {torch.float64}, (config, dtypes)


def bf16_worker(stage: int) -> tuple[float, float]:
    """Error of bf16 ShardedOptimizer and of bf16 DDP + AdamW against fp32 DDP + AdamW."""
    fp32 = list(_train_pair(stage, "none", True, torch.float32))[-1][0]
    pairs = list(_train_pair(stage, "none", True, torch.bfloat16))
    ddp_bf16, sharded_bf16 = pairs[-1][0], pairs[-1][1]
    return relative_error(sharded_bf16, fp32), relative_error(ddp_bf16, fp32)


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_error_at_most_twice_ddp(pools, stage):
    sharded_err, ddp_err = pools[2].run(bf16_worker, stage)[0]
    assert sharded_err <= 2 * ddp_err, f"bf16 error {sharded_err:.3g} vs DDP + AdamW bf16 {ddp_err:.3g}"


def reduce_dtype_worker(stage: int) -> tuple[float, float, set]:
    """bf16 params reduced in fp32: the collective's dtype, and the error against fp32 DDP + AdamW."""
    from zeroshard.comm import collectives

    dtypes = set()
    original = collectives.reduce_scatter

    def recording(output, input, group, **kwargs):
        dtypes.add(input.dtype)
        return original(output, input, group, **kwargs)

    fp32 = list(_train_pair(stage, "none", True, torch.float32))[-1][0]
    collectives.reduce_scatter = recording
    try:
        ddp_bf16, sharded = list(_train_pair(stage, "none", True, torch.bfloat16, None, torch.float32))[-1][:2]
    finally:
        collectives.reduce_scatter = original
    return relative_error(sharded, fp32), relative_error(ddp_bf16, fp32), dtypes


@pytest.mark.parametrize("stage", [1, 2])
def test_reduce_dtype_float32_for_bf16_params(pools, stage):
    sharded_err, ddp_err, dtypes = pools[2].run(reduce_dtype_worker, stage)[0]
    assert dtypes == {torch.float32}
    assert sharded_err <= 2 * ddp_err, f"bf16 error {sharded_err:.3g} vs DDP + AdamW bf16 {ddp_err:.3g}"


def bf16_communication_worker(stage: int, accumulation: str) -> tuple[float, float, set]:
    """fp32 params, gradients communicated in bf16: zeroshard's ``reduce_dtype=torch.bfloat16`` and DDP's
    ``bf16_compress_hook``, each as its error against fp32 DDP + AdamW; and the dtypes zeroshard reduced in.

    ``bf16_compress_hook`` itself refuses gloo (it checks for NCCL), so DDP gets the function it
    delegates to, torch's ``_compress_hook(torch.bfloat16, ...)``: cast the bucket to bf16, divide by
    the world size, all-reduce, copy back into the fp32 bucket.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import _compress_hook

    from zeroshard.comm import collectives

    def bf16_hook(process_group, bucket):  # DDP checks for NCCL by the hook's name
        return _compress_hook(torch.bfloat16, process_group, bucket)

    dtypes = set()
    original = collectives.reduce_scatter

    def recording(output, input, group, **kwargs):
        dtypes.add(input.dtype)
        return original(output, input, group, **kwargs)

    fp32 = list(_train_pair(stage, accumulation, True))[-1][0]
    collectives.reduce_scatter = recording
    try:
        ddp_bf16, sharded, opt = list(_train_pair(stage, accumulation, True, torch.float32, None, torch.bfloat16, ddp_hook=bf16_hook))[-1]
    finally:
        collectives.reduce_scatter = original
    assert all(s.grad_shard.dtype == torch.float32 for s in opt._shards)  # reduced micro-steps accumulate in fp32
    return relative_error(sharded, fp32), relative_error(ddp_bf16, fp32), dtypes


@pytest.mark.parametrize(("stage", "accumulation"), [(1, "none"), (2, "none"), (2, "backward"), (2, "no_sync")])
def test_bf16_communication_is_as_accurate_as_ddps_bf16_hook(pools, stage, accumulation):
    sharded_err, ddp_err, dtypes = pools[2].run(bf16_communication_worker, stage, accumulation)[0]
    assert dtypes == {torch.bfloat16}
    assert 0 < sharded_err <= 2 * ddp_err, f"bf16 communication error {sharded_err:.3g} vs DDP's bf16_compress_hook {ddp_err:.3g}"


def delayed_collectives_worker(stage: int) -> float:
    """Overlap must not race: with every reduce-scatter and all-gather started late on rank 1
    (ranks then run out of step), results still match DDP + AdamW."""
    import time

    from zeroshard.comm import collectives

    originals = collectives.reduce_scatter, collectives.all_gather

    def late(fn):
        def wrapper(*args, **kwargs):
            if dist.get_rank() == 1:
                time.sleep(0.002)
            return fn(*args, **kwargs)
        return wrapper

    # Every module calls the collectives through zeroshard.comm.collectives, so patching it reaches them all.
    collectives.reduce_scatter, collectives.all_gather = late(originals[0]), late(originals[1])
    try:
        worst = 0.0
        for ref_model, model, _ in _train_pair(stage, "backward", True):
            worst = max(worst, tolerance_ratio(model, ref_model))
    finally:
        collectives.reduce_scatter, collectives.all_gather = originals
    return worst


@pytest.mark.parametrize("stage", [1, 2])
def test_delayed_collectives_do_not_race(pools, stage):
    assert all(r <= 1.0 for r in pools[2].run(delayed_collectives_worker, stage))
