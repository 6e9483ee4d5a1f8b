"""The step that keeps the norm, the clip coefficient and the overflow decision on the device (``zeroshard/update.py``).

On CUDA the Triton kernel reads them there and the step reads nothing back to the host. Here the
same kernel runs on the CPU chunks under TRITON_INTERPRET=1 (``fused_adam.KERNEL_ON_CPU``), so the
whole path runs on gloo ranks against DDP + ``torch.optim.AdamW``: the statistics are read back only
where the host must decide (the first step, a param without a gradient on this rank), a NaN on one
rank skips the step everywhere with its step counts taken back, and clipping matches torch's.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from models import TinyNet, batch, loss_fn, param_groups, relative_error
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard
from zeroshard.step import fused_adam
from zeroshard.step.grad_norm import ReducedStats
from zeroshard.step.pending_skip import PendingSkip

STEPS, NAN_STEP, BRANCH_OFF_STEP = 8, 3, 5


def device_decision_worker(stage: int, max_norm: float | None, nan_step: int, branch_off_step: int) -> dict:
    """8 steps of TinyNet: a NaN loss on rank 1 at ``nan_step``, rank 1 without the branch at ``branch_off_step``."""
    fused_adam.KERNEL_ON_CPU = True
    rank = dist.get_rank()
    try:
        torch.manual_seed(0)
        model, ref = TinyNet(), TinyNet()
        ref.load_state_dict(model.state_dict())
        ddp = DDP(ref, find_unused_parameters=True)
        ref_opt = torch.optim.AdamW(param_groups(ref), lr=1e-2)
        opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), stage=stage, max_grad_norm=max_norm,
                                         collective_timeout_s=60)
        reads: list[int] = []
        read = ReducedStats.read
        norms, ref_norms, skipped = [], [], []

        def counted_read(stats: ReducedStats):
            reads.append(len(norms))
            return read(stats)

        with mock.patch.object(ReducedStats, "read", counted_read):
            for step in range(STEPS):
                x, y = batch(rank, step)
                use_branch = not (step == branch_off_step and rank == 1)
                poison = float("nan") if step == nan_step and rank == 1 else 1.0
                (loss_fn(model, x, y, use_branch) * poison).backward()
                before = [p.detach().clone() for p in model.parameters()]
                opt.step()
                model.zero_grad()
                if step == nan_step:  # read the flag only now, after the next step's counting: taken back there
                    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
                else:
                    skipped.append(opt.step_was_skipped)
                norms.append(float(opt.grad_norm))
                (loss_fn(ddp, x, y, use_branch) * poison).backward()
                ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm if max_norm else math.inf)
                ref_norms.append(float(ref_norm))
                if step != nan_step:
                    ref_opt.step()
                ref_opt.zero_grad()
        state = opt.state_dict()
        return {"reads": reads, "skipped": skipped, "unchanged": unchanged, "norms": norms, "ref_norms": ref_norms,
                "error": relative_error(model, ref), "steps": [int(s) for s in state["param_steps"].tolist()],
                "ref_steps": [int(ref_opt.state[p]["step"]) if p in ref_opt.state else 0 for g in ref_opt.param_groups for p in g["params"]]}
    finally:
        fused_adam.KERNEL_ON_CPU = False


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the Triton kernel on CPU chunks (TRITON_INTERPRET=1, set without a GPU)")
@pytest.mark.parametrize("stage, max_norm, branch_off_step", [(1, None, BRANCH_OFF_STEP), (2, 0.5, BRANCH_OFF_STEP), (2, 0.5, NAN_STEP)])
def test_device_decision_matches_ddp_and_reads_back_only_when_the_host_decides(pools, stage, max_norm, branch_off_step):
    """With ``branch_off_step == NAN_STEP`` the ranks decide the skipped step apart (rank 0 on the device, rank 1 on the
    host) and must still run the same collectives (the all-gather after the step)."""
    for rank, run in enumerate(pools[2].run(device_decision_worker, stage, max_norm, NAN_STEP, branch_off_step)):
        # read back at the first step (state is created) and, on rank 1 only, where its branch got no gradient
        assert run["reads"] == ([0, branch_off_step] if rank == 1 else [0]), run["reads"]
        assert run["unchanged"] and not any(run["skipped"]), run["skipped"]
        assert math.isnan(run["norms"][NAN_STEP])
        finite = [i for i in range(STEPS) if i != NAN_STEP]
        assert all(math.isclose(run["norms"][i], run["ref_norms"][i], rel_tol=1e-5) for i in finite), (run["norms"], run["ref_norms"])
        assert run["error"] < 1e-5, run["error"]
        assert run["steps"] == run["ref_steps"] and max(run["steps"]) == STEPS - 1, (run["steps"], run["ref_steps"])


def lr_off_on_device_worker(branch_off: bool) -> tuple[int, bool, str]:
    """Two steps alike, then rank 1 halves its lr (and, with ``branch_off``, its branch gets no gradient, so rank 1's host
    decides while rank 0's device does): (host reads in the third step, params unchanged, what it raised)."""
    fused_adam.KERNEL_ON_CPU = True
    rank = dist.get_rank()
    try:
        torch.manual_seed(0)
        model = TinyNet()
        opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), collective_timeout_s=60)
        for step in range(2):
            loss_fn(model, *batch(rank, step)).backward()
            opt.step()
            model.zero_grad()
        if rank == 1:
            opt.param_groups[0]["lr"] /= 2
        loss_fn(model, *batch(rank, 2), not (branch_off and rank == 1)).backward()
        before = [p.detach().clone() for p in model.parameters()]
        reads: list[int] = []
        read = ReducedStats.read
        with mock.patch.object(ReducedStats, "read", lambda stats: reads.append(1) or read(stats)):
            try:
                opt.step()
                message = "no error"
            except RuntimeError as error:
                message = str(error)
        return len(reads), all(torch.equal(a, b) for a, b in zip(before, model.parameters())), message
    finally:
        fused_adam.KERNEL_ON_CPU = False


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the Triton kernel on CPU chunks (TRITON_INTERPRET=1, set without a GPU)")
@pytest.mark.parametrize("branch_off", [False, True])
def test_an_lr_set_on_one_rank_raises_on_every_rank_where_the_device_decides(pools, branch_off):
    # The check sat in ReducedStats.read only: where the device decided (no read) it was skipped, and where one rank's host
    # decided (a param without a gradient there) that rank raised alone, the other stepping on into the all-gather.
    for rank, (reads, unchanged, message) in enumerate(pools[2].run(lr_off_on_device_worker, branch_off)):
        assert reads == (1 if branch_off and rank == 1 else 0), (rank, reads)
        assert unchanged, rank
        assert message.startswith("step(): the ranks step AdamW's param group 0 with different learning rates (lr here "
                                  f"{0.005 if rank == 1 else 0.01:g}; 0.01 on rank 0; 0.005 on rank 1)"), (rank, message)


def torch_clip_worker(on_device: bool, default_fp64: bool = False) -> tuple[int, list[torch.Tensor]]:
    """5 steps clipped by ``torch.nn.utils.clip_grad_norm_`` on the model's params (what HF Trainer and accelerate run),
    the step deciding on the device or (``on_device=False``) on the host; statistics reads, and the params.
    ``default_fp64``: the fp32 model trains with float64 as torch's default dtype."""
    fused_adam.KERNEL_ON_CPU = True
    try:
        torch.manual_seed(0)
        model = TinyNet()
        opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), stage=2, collective_timeout_s=60)
        if default_fp64:
            torch.set_default_dtype(torch.float64)
        reads: list[int] = []
        read = ReducedStats.read

        def counted_read(stats: ReducedStats):
            reads.append(1)
            return read(stats)

        decide = mock.patch.object(zeroshard.ShardedOptimizer, "_on_device", return_value=False) if not on_device else contextlib.nullcontext()
        with mock.patch.object(ReducedStats, "read", counted_read), decide:
            for step in range(5):
                loss_fn(model, *batch(dist.get_rank(), step)).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                opt.zero_grad()
        return len(reads), [p.detach().clone() for p in model.parameters()]
    finally:
        fused_adam.KERNEL_ON_CPU = False
        torch.set_default_dtype(torch.float32)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the Triton kernel on CPU chunks (TRITON_INTERPRET=1, set without a GPU)")
def test_a_step_after_torch_clip_grad_norm_decides_on_the_device_bitwise_as_on_the_host(pools):
    device, host = pools[2].run(torch_clip_worker, True), pools[2].run(torch_clip_worker, False)
    # float64 as the default dtype changes none of the device's scalars (the kernel takes fp32 ones only)
    default_fp64 = pools[2].run(torch_clip_worker, True, True)
    for (reads, params), (host_reads, host_params), (_, fp64_params) in zip(device, host, default_fp64):
        assert (reads, host_reads) == (1, 5)  # the first step reads back (state is created), then none
        assert all(torch.equal(a, b) for a, b in zip(params, host_params))
        assert all(torch.equal(a, b) for a, b in zip(fp64_params, host_params))


def gradscaler_after_clip_worker() -> list[float]:
    """A ``torch.amp.GradScaler`` stepping after ``opt.clip_grad_norm_`` (no ``unscale_``), an inf in one param's
    gradient at step 3 (in one rank's shard only); the GradScaler's scale after each step."""
    fused_adam.KERNEL_ON_CPU = True
    try:
        torch.manual_seed(0)
        model = TinyNet()
        opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), stage=2, collective_timeout_s=60)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
        scales = []
        for step in range(5):
            hook = model.norm.bias.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), math.inf)) if step == 3 else None
            scaler.scale(loss_fn(model, *batch(dist.get_rank(), step))).backward()
            if hook is not None:
                hook.remove()
            opt.clip_grad_norm_(1.0)  # decided before the GradScaler hands over its scale
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            model.zero_grad()
        return scales
    finally:
        fused_adam.KERNEL_ON_CPU = False


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the Triton kernel on CPU chunks (TRITON_INTERPRET=1, set without a GPU)")
def test_a_gradscaler_stepping_after_clip_grad_norm_gets_every_rank_s_overflow(pools):
    # the step re-decides once the GradScaler stepped in: host decision, its found_inf set on every rank, one scale
    assert pools[2].run(gradscaler_after_clip_worker) == [[1024.0, 1024.0, 1024.0, 512.0, 512.0]] * 2


FP16_STEPS, INF_STEPS = 8, (3, 4)


def fp16_dynamic_scale_worker(stage: int, on_device: bool) -> dict:
    """fp16 TinyNet with a dynamic loss scale (growth every 2 finite steps, hysteresis 2), an inf in rank 1's loss at
    INF_STEPS, nothing read during the steps; the step deciding on the device or (``on_device=False``) on the host.
    The statistics and the scale's host reads during the steps, then the scaler's state, skips, step counts and params."""
    fused_adam.KERNEL_ON_CPU = True
    try:
        torch.manual_seed(0)
        model = TinyNet().half()
        scaler = zeroshard.DynamicLossScaler(initial_scale=256.0, growth_interval=2, hysteresis=2)
        opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), stage=stage, loss_scale=scaler,
                                         max_grad_norm=1.0, collective_timeout_s=60)
        reads: list[str] = []
        read, pull = ReducedStats.read, zeroshard.DynamicLossScaler._pull

        def counted_read(stats: ReducedStats):
            reads.append("statistics")
            return read(stats)

        def counted_pull(self):
            if self._device_state is not None:
                reads.append("scale")
            return pull(self)

        decide = mock.patch.object(zeroshard.ShardedOptimizer, "_on_device", return_value=False) if not on_device else contextlib.nullcontext()
        with mock.patch.object(ReducedStats, "read", counted_read), mock.patch.object(zeroshard.DynamicLossScaler, "_pull", counted_pull), decide:
            for step in range(FP16_STEPS):
                loss = loss_fn(model, *batch(dist.get_rank(), step))
                opt.backward(loss * math.inf if step in INF_STEPS and dist.get_rank() == 1 else loss)
                opt.step()
                opt.zero_grad()
        state = opt.state_dict()
        return {"reads": reads, "scaler": scaler.state_dict(), "skipped": opt._skipped_steps, "steps": state["param_steps"].tolist(),
                "params": [p.detach().clone() for p in model.parameters()], "norm": float(opt.grad_norm)}
    finally:
        fused_adam.KERNEL_ON_CPU = False


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the Triton kernel on CPU chunks (TRITON_INTERPRET=1, set without a GPU)")
@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_dynamic_loss_scale_decides_on_the_device_bitwise_as_on_the_host(pools, stage):
    device, host = pools[2].run(fp16_dynamic_scale_worker, stage, True), pools[2].run(fp16_dynamic_scale_worker, stage, False)
    for run, ref in zip(device, host):
        assert run["reads"] == ["statistics"], run["reads"]  # the first step only (state is created); the scale never
        assert len(ref["reads"]) == FP16_STEPS
        # grown at steps 1 and 6, the first inf absorbed (hysteresis), the second backed off: 256 -> 512 -> 256 -> 512
        assert run["scaler"] == ref["scaler"] == {"scale": 512.0, "growth_tracker": 1, "hysteresis_tracker": 2}, (run["scaler"], ref["scaler"])
        assert run["skipped"] == ref["skipped"] == len(INF_STEPS)
        assert run["steps"] == ref["steps"] and max(run["steps"]) == FP16_STEPS - len(INF_STEPS)
        assert run["norm"] == ref["norm"]
        assert all(torch.equal(a, b) for a, b in zip(run["params"], ref["params"]))


@pytest.fixture
def nccl_group(tmp_path):
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, clip", [(torch.float32, "optimizer"), (torch.bfloat16, "optimizer"), (torch.float16, "optimizer"),
                                         (torch.float32, "optimizer, coefficient 1"), (torch.float32, "torch"), (torch.bfloat16, "torch")])
def test_cuda_training_step_makes_no_host_sync(nccl_group, dtype, clip):
    """After the first step, backward + clipped step + zero_grad run under ``torch.cuda.set_sync_debug_mode("error")``
    (which raises at any synchronizing CUDA call), and the result is what the host path gives; fp16 with a dynamic
    loss scale (``opt.backward``), kept on the device; ``clip="torch"``: ``torch.nn.utils.clip_grad_norm_`` on the
    model's params (HF Trainer's, accelerate's), where the optimizer clips nothing (the host's multiplier is 1.0, as it is
    with a clip coefficient of 1)."""
    torch.manual_seed(0)
    models = [TinyNet().to("cuda", dtype) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    scaling = {"loss_scale": zeroshard.DynamicLossScaler(initial_scale=256.0, growth_interval=2)} if dtype == torch.float16 else {}
    max_norm = {"optimizer": 0.5, "optimizer, coefficient 1": 1e6}.get(clip)  # 1e6: the clip multiplies by 1.0, a device 1.0
    opts = [zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(m), lr=1e-2), max_grad_norm=max_norm, **copy.deepcopy(scaling))
            for m in models]

    def backward(model, opt, loss):
        opt.backward(loss)
        if clip == "torch":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)

    batches = [[t.cuda() for t in batch(0, step)] for step in range(4)]
    for step, (x, y) in enumerate(batches):
        for k, (model, opt) in enumerate(zip(models, opts)):
            loss = loss_fn(model, x, y)
            if k == 1:  # the reference: the statistics read back (as where the host must decide)
                with mock.patch.object(zeroshard.ShardedOptimizer, "_on_device", return_value=False):
                    backward(model, opt, loss)
                    opt.step()
                opt.zero_grad()
                continue
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if step else "default")  # the first step creates state on the host's read
            try:
                backward(model, opt, loss)
                opt.step()
                opt.zero_grad()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    assert not opts[0].step_was_skipped
    assert float(opts[0].grad_norm) == float(opts[1].grad_norm)
    assert opts[0].loss_scale == opts[1].loss_scale
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a pinned copy behind an event)")
def test_pending_skip_takes_over_the_buffer_of_a_flag_already_read_only():
    """The next step's flag is copied into the last one's pinned buffer once that was read, never while a copy may be in flight."""
    first = PendingSkip(torch.ones(1, device="cuda"), [[1]])
    assert first.skipped() and first.read
    second = PendingSkip(torch.zeros(1, device="cuda"), [[2]], reuse=first)
    assert second._values is first._values
    assert not second.skipped()
    assert first.skipped()  # its answer was kept, not read again from the buffer now holding the second's
    third = PendingSkip(torch.ones(1, device="cuda"), [[3]], reuse=second)
    fourth = PendingSkip(torch.zeros(1, device="cuda"), [[4]], reuse=third)  # the third unread: a buffer of its own
    assert fourth._values is not third._values
    assert third.skipped() and not fourth.skipped()
    scaled = PendingSkip(torch.ones(1, device="cuda"), [[5]], torch.tensor(8.0, dtype=torch.float64, device="cuda"), reuse=fourth)
    assert scaled._values is not fourth._values and scaled.skipped() and scaled.loss_scale() == 8.0

