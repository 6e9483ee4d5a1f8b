"""CPU offload (master and Adam state in host memory) and the memory tracer, on gloo ranks.

On a CPU-only machine offload keeps separate host buffers, so the device -> host -> device path runs.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import threading
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from models import TinyNet, batch, loss_fn, param_groups, relative_error, tolerance_ratio
from test_parity import _train_pair

import zeroshard
from zeroshard.layout.chunk import Chunk, chunks_of
from zeroshard.layout.flat_buffer import FlatParamBuffer
from zeroshard.layout.local_shard import LocalShard
from zeroshard.offload.placement import MarginMeasurement, chunk_device_bytes, measure_margin, plan_placement


def offload_parity_worker(stage: int, accumulation: str, max_grad_norm: float | None) -> float:
    worst = 0.0
    for ref_model, model, _ in _train_pair(stage, accumulation, True, max_grad_norm=max_grad_norm, offload="cpu"):
        worst = max(worst, tolerance_ratio(model, ref_model))
    return worst


@pytest.mark.parametrize("stage, accumulation, max_grad_norm", [(1, "none", None), (2, "none", None), (2, "no_sync", 0.5), (1, "backward", 0.5)])
def test_offload_matches_ddp_adamw(pools, stage, accumulation, max_grad_norm):
    for worst in pools[2].run(offload_parity_worker, stage, accumulation, max_grad_norm):
        assert worst <= 1.0, f"{worst:.3g}x the tolerance (rtol 1e-6, atol 1e-7)"


def on_off_worker(stage: int) -> float:
    """Offload on vs off, fp32, 20 steps, same data; after step 10 the params are clamped in place under no_grad (weight
    clipping): without offload that writes the master (the flat buffer), with it the next step copies it into the host master."""
    runs = {}
    for offload in (None, "cpu"):
        torch.manual_seed(0)
        model = TinyNet()
        opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), stage=stage, offload=offload)
        for step in range(20):
            loss_fn(model, *batch(dist.get_rank(), step)).backward()
            opt.step()
            model.zero_grad()
            if step == 10:
                with torch.no_grad():
                    for p in model.parameters():
                        p.clamp_(-0.05, 0.05)
        runs[offload] = model
    return tolerance_ratio(runs["cpu"], runs[None])


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_on_and_off_agree(pools, stage):
    assert all(r <= 1.0 for r in pools[2].run(on_off_worker, stage))


def low_precision_offload_worker(dtype: torch.dtype) -> tuple[float, float, float | None]:
    fp32 = list(_train_pair(2, "none", True, torch.float32))[-1][0]
    ddp_bf16 = list(_train_pair(2, "none", True, torch.bfloat16))[-1][0]
    _, sharded, opt = list(_train_pair(2, "none", True, dtype, offload="cpu"))[-1]
    return relative_error(sharded, fp32), relative_error(ddp_bf16, fp32), opt.loss_scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_offload_with_mixed_precision_and_loss_scaling(pools, dtype):
    err, bf16_ddp_err, scale = pools[2].run(low_precision_offload_worker, dtype)[0]
    assert (scale is not None) == (dtype == torch.float16)
    assert err <= 2 * bf16_ddp_err, (err, bf16_ddp_err)


def fused_bitwise_worker(adamw: bool, offload: str | None) -> bool:
    """One rank, fp32, 6 steps: against torch's own ``fused=True`` optimizer (params and state).
    ``offload=None``: the wrapped optimizer is ``fused=True`` too, stepped on the device (here the
    CPU). Params of odd sizes in two groups and several chunks: the 29 and 13 elements sit inside
    runs, where torch's kernel would take their last elements through its vector body instead of
    its tail loop unless the runs are cut (see ``FusedAdam._runs``). The loss is linear in the
    params, so both see exactly the same gradients (a model's forward could differ in the last
    bit between the flat buffer's views and separate params); the last param is unused in steps
    1 and 4, so its runs lag the others' step count."""
    g = torch.Generator().manual_seed(0)
    sizes = (7, 4097, 29, 13, 300, 1000)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]

    def groups(ps: list[torch.nn.Parameter]) -> list[dict]:
        return [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]

    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = zeroshard.ShardedOptimizer(cls(groups(params), lr=1e-2, fused=offload is None), offload=offload, bucket_size_mb=2000 * 4 / 2**20)
    ref = cls(groups(ref_params), lr=1e-2, fused=True)
    for step in range(6):
        used = sizes if step % 3 != 1 else sizes[:-1]
        grads = [torch.randn(n, generator=g) for n in used]
        for ps, o in ((params, opt), (ref_params, ref)):
            sum((p * grad).sum() for p, grad in zip(ps, grads)).backward()
            o.step()
            o.zero_grad()
    opt.consolidate_state_dict(to=0)
    full = opt.state_dict()["state"]
    return (len(chunks_of(opt._shards)) > 2
            and all(torch.equal(full[i][key], value) for i, entry in ref.state_dict()["state"].items() for key, value in entry.items())
            and all(torch.equal(a, b) for a, b in zip(params, ref_params)))


@pytest.mark.parametrize("adamw, offload", [(True, "cpu"), (False, "cpu"), (True, None)])
def test_fused_update_equals_torch_fused_bitwise(pools, adamw, offload):
    assert pools[1].run(fused_bitwise_worker, adamw, offload) == [True]


@pytest.mark.parametrize("adamw, maximize", [(True, False), (True, True), (False, False)])
def test_host_adam_equals_torch_fused_per_param(adamw, maximize):
    """The CPU update as a function: two runs at different step counts in one call, gradients
    divided by grad_scale, against torch's ``fused=True`` optimizer stepping each run as a param
    with the same grad_scale (bitwise: the same kernel)."""
    from zeroshard.step.fused_adam import Run, host_adam

    g = torch.Generator().manual_seed(0)
    group = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1, "maximize": maximize}
    grad_scale = torch.tensor([4.0])
    runs, references = [], []
    for numel, step in ((7, 1), (4097, 4)):
        param, grad = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
        exp_avg, exp_avg_sq = torch.randn(numel, generator=g) * 0.1, torch.rand(numel, generator=g) * 0.01
        reference = torch.nn.Parameter(param.clone())
        reference.grad = grad.clone()
        optimizer = (torch.optim.AdamW if adamw else torch.optim.Adam)([reference], fused=True, **group)
        optimizer.state[reference] = {"step": torch.tensor(float(step - 1)), "exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone()}
        optimizer.grad_scale = grad_scale  # what torch.amp.GradScaler hands a fused optimizer
        optimizer.step()
        references.append((reference.detach(), optimizer.state[reference]))
        runs.append(Run(param, grad, exp_avg, exp_avg_sq, None, step))
    host_adam(runs, group, adamw, grad_scale)
    for run, (param, state) in zip(runs, references):
        assert torch.equal(run.param, param) and torch.equal(run.exp_avg, state["exp_avg"]) and torch.equal(run.exp_avg_sq, state["exp_avg_sq"])


def offload_memory_worker() -> tuple[int, int, int, int]:
    torch.manual_seed(0)
    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), offload="cpu")
    loss_fn(model, *batch(dist.get_rank(), 0)).backward()
    opt.step()
    usage = opt.memory_usage().by_kind
    shard_numel = sum(s.buffer.layout.shard_numel for s in opt._shards)
    return usage["master"], usage["grad_shard"], usage["optimizer_state"], shard_numel


def test_offload_memory_usage_counts_host_buffers(pools):
    for master, grad_shard, state, shard_numel in pools[2].run(offload_memory_worker):
        assert master == 4 * shard_numel  # a separate fp32 master even for fp32 params
        assert grad_shard == 2 * 4 * shard_numel  # the grad shard and its host copy
        assert state >= 8 * shard_numel  # flat exp_avg + exp_avg_sq (+ step counters)


def _chunk_bytes(opt: zeroshard.ShardedOptimizer) -> list[int]:
    """Device bytes of each chunk of ``opt``, in layout order (what ``opt.placement.chunk_bytes`` will list)."""
    return [chunk_device_bytes(chunk) for chunk in chunks_of(opt._shards)]


def _margin_of(opt: zeroshard.ShardedOptimizer, keep: int) -> mock._patch:
    """A patch of the first iteration's measured margin: exactly the first ``keep`` chunks (ratio 1)."""
    return mock.patch("zeroshard.offload.placement.measure_margin", return_value=MarginMeasurement(sum(_chunk_bytes(opt)[:keep]), 0, 0, 0))


def across_offload_worker(directory: str) -> list[float]:
    """Saved with offload, loaded without, and back, and with part of the state placed on the
    device by gpu_margin_mem_ratio (through DCP): training continues alike."""
    def build(offload, seed):
        torch.manual_seed(seed)
        model = TinyNet()
        opt = zeroshard.ShardedOptimizer(
            torch.optim.AdamW(param_groups(model), lr=1e-2), offload=offload and "cpu", bucket_size_mb=200 * 4 / 2**20,
            gpu_margin_mem_ratio=1.0 if offload == "mixed" else 0.0,
        )
        return model, opt

    def train(model, opt, steps):
        with _margin_of(opt, 2):  # placed at the first step (with gpu_margin_mem_ratio)
            for step in steps:
                loss_fn(model, *batch(dist.get_rank(), step)).backward()
                opt.step()
                model.zero_grad()

    results = []
    for saver, loader in (("cpu", None), (None, "cpu"), ("mixed", None), (None, "mixed")):
        model, opt = build(saver, 0)
        train(model, opt, range(3))
        dcp.save({"model": model.state_dict(), "optim": opt}, checkpoint_id=f"{directory}/{saver}")
        resumed, ropt = build(loader, 1)
        state = {"model": resumed.state_dict(), "optim": ropt}
        dcp.load(state, checkpoint_id=f"{directory}/{saver}")
        resumed.load_state_dict(state["model"])
        train(model, opt, range(3, 6))
        train(resumed, ropt, range(3, 6))
        results.append(tolerance_ratio(resumed, model))
        for o in (opt, ropt):  # the chunks placed on the device are the planned ones
            assert o.gpu_margin_mem_ratio == 0 or sum(o.placement.on_device) == 2, o.placement
            assert (o.placement is None) == (o.gpu_margin_mem_ratio == 0)
    return results


def test_checkpoints_load_across_offload_settings(pools, tmp_path):
    for ratios in pools[2].run(across_offload_worker, str(tmp_path)):
        assert all(r <= 1.0 for r in ratios), ratios


def sgd_offload_worker() -> None:
    with pytest.raises(ValueError, match="offload='cpu' runs torch's fused CPU Adam/AdamW: .* got SGD"):
        zeroshard.ShardedOptimizer(torch.optim.SGD(TinyNet().parameters(), lr=0.1), offload="cpu")
    with pytest.raises(ValueError, match="offload='gpu' must be None or 'cpu'"):
        zeroshard.ShardedOptimizer(torch.optim.AdamW(TinyNet().parameters()), offload="gpu")
    with pytest.raises(TypeError, match="offload=True must be None or the str 'cpu'"):  # DeepSpeed's flag spelled as a bool
        zeroshard.ShardedOptimizer(torch.optim.AdamW(TinyNet().parameters()), offload=True)
    with pytest.raises(ValueError, match="gpu_margin_mem_ratio=0.5 places offloaded state: it needs offload='cpu'"):
        zeroshard.ShardedOptimizer(torch.optim.AdamW(TinyNet().parameters()), gpu_margin_mem_ratio=0.5)
    with pytest.raises(ValueError, match="gpu_margin_mem_ratio=1.5 must be a number between 0.0 and 1.0"):
        zeroshard.ShardedOptimizer(torch.optim.AdamW(TinyNet().parameters()), offload="cpu", gpu_margin_mem_ratio=1.5)


def test_offload_refuses_other_optimizers(pools):
    pools[2].run(sgd_offload_worker)


def test_memory_tracer_sees_what_the_region_allocates():
    size = 256 * 2**20
    with zeroshard.MemoryTracer(device="cpu") as tracer:
        block = torch.ones(size // 4)  # touched, so resident
        time.sleep(0.05)
        del block
    grown = tracer.device_peak_bytes - tracer.device_baseline_bytes
    assert 0.9 * size <= grown <= 1.5 * size, grown
    assert tracer.device_capacity_bytes > size
    assert tracer.non_model_peak_bytes(model_data_bytes=tracer.device_peak_bytes) == 0
    assert "peak" in tracer.summary(model_data_bytes=0)
    with pytest.raises(ValueError, match="sample_interval_s=0"):
        zeroshard.MemoryTracer(sample_interval_s=0)


# -- gpu_margin_mem_ratio: placement ------------------------------------------------------------

CHUNKS = [100, 200, 50, 300]


@pytest.mark.parametrize("margin, ratio, expected", [
    (10_000, 0.0, [False, False, False, False]),  # 0.0: classic full offload
    (10_000, 1.0, [True, True, True, True]),  # everything fits
    (400, 1.0, [True, True, True, False]),  # 100 + 200 + 50 = 350 <= 400; 300 does not fit in 50
    (400, 0.5, [True, False, True, False]),  # budget 200: 100, then 200 > 100 left, then 50
    (40, 1.0, [False, False, False, False]),  # a margin smaller than any chunk
    (0, 1.0, [False, False, False, False]),
])
def test_plan_placement_keeps_whole_chunks_within_ratio_times_margin(margin, ratio, expected):
    plan = plan_placement(CHUNKS, margin, ratio)
    assert plan == expected
    assert sum(size for size, keep in zip(CHUNKS, plan) if keep) <= ratio * margin


def test_margin_is_capacity_less_peak_model_data_and_headroom():
    assert MarginMeasurement(10_000, 3_000, 2_000, 500).margin_bytes == 4_500
    assert MarginMeasurement(10_000, 6_000, 4_000, 500).margin_bytes == 0  # never negative
    tracer = zeroshard.MemoryTracer(device="cpu")
    tracer.device_peak_bytes, tracer.device_available_bytes = 7_000, 20_000
    measurement = measure_margin(tracer, model_data_bytes=3_000, headroom=0.05)
    assert measurement == MarginMeasurement(20_000, 4_000, 3_000, 1_000)
    with pytest.raises(ValueError, match="gpu_margin_mem_ratio=1.5"):
        plan_placement(CHUNKS, 100, 1.5)


def placement_worker(keep: int | None, ratio: float, dtype: torch.dtype) -> tuple[list[bool], list[bool], float, list[str]]:
    """Train with offload and an injected margin worth the first ``keep`` chunks at ``ratio``
    (``None``: the tracer's real measurement) next to the same run without offload."""
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("zeroshard").addHandler(handler)
    logging.getLogger("zeroshard").setLevel(logging.INFO)
    models, opts = {}, {}
    for offload in (None, "cpu"):
        torch.manual_seed(0)
        model = TinyNet().to(dtype)
        opt = zeroshard.ShardedOptimizer(
            torch.optim.AdamW(param_groups(model), lr=1e-2), stage=2, bucket_size_mb=200 * 4 / 2**20, offload=offload,
            gpu_margin_mem_ratio=ratio if offload else 0.0,
        )
        injected = contextlib.nullcontext()
        if offload and keep is not None:
            margin = math.ceil(sum(_chunk_bytes(opt)[:keep]) / ratio)  # ratio x margin: the first ``keep`` chunks, give or take a byte
            # capacity - non-model peak - model data - headroom = margin
            injected = mock.patch("zeroshard.offload.placement.measure_margin", return_value=MarginMeasurement(margin + 900, 500, 300, 100))
        with injected:
            for step in range(20):
                loss_fn(model, *batch(dist.get_rank(), step)).backward()
                opt.step()
                model.zero_grad()
        models[offload], opts[offload] = model, opt
    logging.getLogger("zeroshard").removeHandler(handler)
    opt = opts["cpu"]
    assert opt.placement.chunk_bytes == tuple(_chunk_bytes(opt)) and opt.placement.ratio == ratio
    assert opt.placement.device_bytes + opt.placement.host_bytes == sum(opt.placement.chunk_bytes)
    assert opt.placement.device_bytes <= ratio * opt.placement.measurement.margin_bytes
    chunks = chunks_of(opt._shards)
    for chunk in chunks:  # the optimizer's params (virtual params) follow their chunk and hold its values
        for piece, vparam in zip(chunk.pieces, chunk.virtual_params):
            assert vparam.data_ptr() == chunk.view(piece).data_ptr()
            assert torch.equal(vparam.detach().to(chunk.params.dtype), chunk.view(piece, chunk.params))
    host_grads = [chunk.host_grad is not None for chunk in chunks]
    error = tolerance_ratio(models["cpu"], models[None]) if dtype == torch.float32 else relative_error(models["cpu"], models[None])
    return list(opt.placement.on_device), host_grads, error, [r for r in records if "gpu_margin_mem_ratio" in r]


@pytest.mark.parametrize("keep, ratio, dtype", [
    (2, 1.0, torch.float32), (3, 0.5, torch.float32), (0, 1.0, torch.float32),  # 0: a margin smaller than one chunk
    (2, 0.25, torch.bfloat16), (None, 1.0, torch.float32),  # None: the tracer's own measurement
])
def test_margin_placement_moves_whole_chunks_and_training_matches(pools, keep, ratio, dtype):
    results = pools[2].run(placement_worker, keep, ratio, dtype)
    for rank, (placed, host_grads, error, lines) in enumerate(results):
        assert len(placed) >= 4, "the test model must span several chunks"
        # The CPU "device" has gigabytes free, so the real measurement keeps everything there.
        expected = [True] * len(placed) if keep is None else [i < keep for i in range(len(placed))]
        assert placed == expected
        assert not any(p and h for p, h in zip(placed, host_grads)), "a chunk on the device keeps no host gradient copy"
        if dtype == torch.float32:
            assert error <= 1.0, f"{error:.3g}x the tolerance (rtol 1e-6) against the same run without offload"
        else:
            assert error <= 1e-3, error
        assert len(lines) == (1 if rank == 0 else 0), lines  # logged once, by rank 0
    assert f"{sum(results[0][0])} of {len(results[0][0])} chunks" in results[0][3][0]


def tracer_thread_worker() -> tuple[int, int, int]:
    """Sampler threads alive: while the first iteration is traced, after the first step, after
    dropping an optimizer that never stepped."""
    def samplers() -> int:
        time.sleep(0.05)  # a stopped sampler wakes from its wait first
        return sum(t.name == "zeroshard-memory-tracer" for t in threading.enumerate())

    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(model.parameters()), offload="cpu", gpu_margin_mem_ratio=0.5)
    tracing = samplers()
    loss_fn(model, *batch(dist.get_rank(), 0)).backward()
    opt.step()
    after_step = samplers()
    never_stepped = zeroshard.ShardedOptimizer(torch.optim.AdamW(TinyNet().parameters()), offload="cpu", gpu_margin_mem_ratio=0.5)
    del never_stepped
    gc.collect()
    return tracing, after_step, samplers()


def test_first_iteration_tracer_stops(pools):
    for counts in pools[2].run(tracer_thread_worker):
        assert counts == (1, 0, 0), counts


def placement_oom_worker() -> tuple[list[bool], float, list[str]]:
    """The device runs out of memory while the second of three planned chunks moves: that chunk
    and the rest stay on the host, the step goes on, and training matches no offload."""
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("zeroshard").addHandler(handler)
    logging.getLogger("zeroshard").setLevel(logging.INFO)
    original = Chunk.move_to_device

    def flaky_move_to_device(chunk):
        if flaky.call_count == 2:
            raise torch.cuda.OutOfMemoryError("injected: no room for this chunk")
        original(chunk)

    try:
        models = {}
        for offload in (None, "cpu"):
            torch.manual_seed(0)
            model = TinyNet()
            opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), bucket_size_mb=200 * 4 / 2**20,
                                             offload=offload, gpu_margin_mem_ratio=1.0 if offload else 0.0)
            with _margin_of(opt, 3), mock.patch.object(Chunk, "move_to_device", autospec=True, side_effect=flaky_move_to_device) as flaky:
                for step in range(10):
                    loss_fn(model, *batch(dist.get_rank(), step)).backward()
                    opt.step()
                    model.zero_grad()
            models[offload] = (model, opt)
    finally:
        logging.getLogger("zeroshard").removeHandler(handler)
    opt = models["cpu"][1]
    placed = list(opt.placement.on_device)
    assert opt.placement.planned[:3] == (True, True, True) and opt.placement.ran_out_of_memory
    separate = [chunk.master is not None for chunk in chunks_of(opt._shards)]
    assert separate == [not p for p in placed], "chunks left on the host keep a master of their own"
    return placed, tolerance_ratio(models["cpu"][0], models[None][0]), [r for r in records if "gpu_margin_mem_ratio" in r]


def test_placement_stops_at_out_of_memory_and_training_goes_on(pools):
    for rank, (placed, worst, lines) in enumerate(pools[2].run(placement_oom_worker)):
        assert placed[:3] == [True, False, False] and not any(placed[3:]), placed
        assert worst <= 1.0, worst
        if rank == 0:
            assert lines and lines[0].endswith("(the device ran out of memory after 1 of the 3 planned)"), lines


def test_chunk_moves_all_or_nothing():
    """A chunk whose move runs out of memory halfway (its exp_avg copied, its exp_avg_sq not) is left
    exactly as it was; a move that succeeds takes master, moments and virtual params along and drops
    the host buffers. One process, no process group: a shard of rank 1 of 2."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 3, 8)]
    shard = LocalShard(FlatParamBuffer(params, 6, 2), 1, host_master=True)
    chunk = shard.chunks[0]
    chunk.allocate_moments()
    chunk.exp_avg.fill_(1.0)
    chunk.host_grad_buffer()
    owned = (chunk.master, chunk.exp_avg, chunk.exp_avg_sq, chunk.host_grad)
    views = [v.data_ptr() for v in chunk.virtual_params]
    original, copies = torch.Tensor.to, []

    def second_copy_fails(tensor, *args, **kwargs):
        copies.append(tensor)
        if len(copies) == 2:
            raise torch.cuda.OutOfMemoryError("injected: no room for exp_avg_sq")
        return original(tensor, *args, **kwargs)

    with mock.patch.object(torch.Tensor, "to", new=second_copy_fails), pytest.raises(torch.cuda.OutOfMemoryError):
        chunk.move_to_device()
    assert len(copies) == 2 and copies[0] is chunk.exp_avg and copies[1] is chunk.exp_avg_sq
    assert chunk.on_host and chunk.device == torch.device("cpu")
    assert all(now is then for now, then in zip((chunk.master, chunk.exp_avg, chunk.exp_avg_sq, chunk.host_grad), owned))
    assert [v.data_ptr() for v in chunk.virtual_params] == views

    master_values = chunk.master.clone()
    chunk.move_to_device()  # on a CPU-only machine the params' device is the host: fp32 params drop their master
    assert not chunk.on_host and chunk.master is None and chunk.host_grad is None
    assert torch.equal(chunk.params, master_values) and torch.equal(chunk.exp_avg, torch.ones(chunk.numel))
    for piece, vparam in zip(chunk.pieces, chunk.virtual_params):
        assert vparam.data_ptr() == chunk.view(piece, chunk.params).data_ptr()
    assert chunk_device_bytes(chunk) == 8 * chunk.numel
    assert all(c.on_host for c in shard.chunks[1:]), "the other chunks stay where they were"
