"""The param all-gather overlapped with what follows ``step()`` (``overlap_param_gather``).

A delay is injected before one rank launches its all-gathers (STYLE: "inject a delay before a
collective to expose races"): the other rank's ``step()`` returns with its gathers still waiting
for that rank, and whatever it reads next must see every rank's update, not the values from
before the step. A negative control runs the same reads with the guard's waiting switched off
and must see stale values, so the delay does expose the race.
"""

from __future__ import annotations

import contextlib
import threading
import time
import types
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import TinyNet, batch, loss_fn, param_groups

import zeroshard
from zeroshard import compat
from zeroshard.comm import collectives
from zeroshard.gather import param_gather

DELAY_S = 0.5
SMALL_BUCKETS_MB = 0.0005  # ~130 fp32 elements: TinyNet's params span several buckets


@contextlib.contextmanager
def _delayed_all_gathers(delay_s: float):
    """Sleep ``delay_s`` before the first bucket all-gather launched in the block, which delays every later one too:
    they are launched after it."""
    slept = []

    def delayed(real):
        def launch(*args):
            if not slept:
                slept.append(time.sleep(delay_s))
            return real(*args)

        return launch

    with mock.patch.object(collectives, "all_gather", delayed(collectives.all_gather)):
        yield


EACH_DELAY_S = 0.03


@contextlib.contextmanager
def _delayed_gathers(delay_s: float):
    """Sleep ``delay_s`` before every bucket all-gather launched in the block."""

    def delayed(real):
        def launch(*args):
            time.sleep(delay_s)
            return real(*args)

        return launch

    with mock.patch.object(collectives, "all_gather", delayed(collectives.all_gather)):
        yield


def _read(how: str, model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Read the params right after ``step()`` the way user code does."""
    params = list(model.parameters())
    if how == "clone":
        return [p.detach().clone() for p in params]
    if how == "state_dict":
        return [t.clone() for t in model.state_dict().values()][: len(params)]
    if how == "ema":  # torch.optim.swa_utils-style EMA: one foreach op over the param list
        ema = [torch.zeros_like(p) for p in params]
        torch._foreach_lerp_(ema, [p.detach() for p in params], 1.0)
        return ema
    if how == "forward":
        with torch.no_grad():
            return [model(x)]
    if how == "compiled_forward":  # Dynamo sees the active mode and honours it
        with torch.no_grad():
            return [torch.compile(model, backend="eager")(x)]
    if how == "compiled_function":  # a compiled function calling the model: the waits run outside its compiled frames
        with torch.no_grad():
            return [torch.compile(lambda x: model(x), backend="eager")(x)]
    if how == "traced_forward":  # ``model`` traced before the step: its C++ forward reads params past the mode
        with torch.no_grad():
            return [model(x)]
    raise ValueError(how)


def overlapped_reads_worker(how: str, guard_waits: bool) -> bool:
    """Step with rank 1's gathers delayed, read at once on every rank; whether the reads were current."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=0.1), bucket_size_mb=SMALL_BUCKETS_MB)
    x, y = batch(rank, 0)
    reader = torch.jit.trace(model, x) if how == "traced_forward" else model  # shares model's params
    loss_fn(model, x, y).backward()
    passthrough = mock.patch.object(param_gather._ParamGuard, "__torch_function__",
                                    lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {})))
    with _delayed_all_gathers(DELAY_S if rank == 1 else 0.0):
        opt.step()
    opt.zero_grad()
    assert opt._gather.pending == sum(len(shard.chunks) for shard in opt._shards) or rank == 1, "one gather per bucket, in flight"
    if guard_waits:
        read = _read(how, reader, x)
    else:
        with passthrough:
            read = _read(how, reader, x)
    opt.wait_params()
    final = _read(how, reader, x)
    current = all(torch.equal(a, b) for a, b in zip(read, final))
    opt.close()
    return current


@pytest.mark.parametrize("how", ["clone", "state_dict", "ema", "forward", "compiled_forward", "compiled_function", "traced_forward"])
def test_reads_after_step_see_every_ranks_update(pools, how):
    assert pools[2].run(overlapped_reads_worker, how, True) == [True, True]


def fullgraph_function_worker() -> tuple[str, bool]:
    """A ``torch.compile(fullgraph=True)`` function calling the model right after ``step()``: what it raised; then, after
    ``opt.wait_params()``, whether it computes what the eager model does."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=0.1), bucket_size_mb=SMALL_BUCKETS_MB)
    x, y = batch(dist.get_rank(), 0)
    loss_fn(model, x, y).backward()
    opt.step()
    forward = torch.compile(lambda x: model(x), backend="eager", fullgraph=True)
    raised = ""
    with torch.no_grad():
        try:
            forward(x)
        except Exception as error:  # Dynamo's Unsupported, which carries zeroshard's reason
            raised = str(error)
        opt.wait_params()
        same = torch.equal(forward(x), model(x))
    opt.close()
    return raised, same


def test_a_fullgraph_compiled_function_during_the_gather_names_the_way_out(pools):
    # Dynamo's "Dynamo does not know how to trace method is_completed of class Work", naming no remedy, before.
    for raised, same in pools[2].run(fullgraph_function_worker):
        assert "call opt.wait_params() before a torch.compile(fullgraph=True) function" in raised, raised
        assert same


def first_read_waits_for_all_worker() -> list[int]:
    """Off CUDA a wait blocks the host, so the first param read waits for every gather: the guard is off the mode stack by
    the forward's next module call. The mode depth at each Linear's call in the forward that follows ``step()``."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), bucket_size_mb=SMALL_BUCKETS_MB)
    depths: list[int] = []
    for layer in model:
        layer.register_forward_pre_hook(lambda module, args: depths.append(len(compat.function_mode_stack())))
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    opt.step()
    assert opt._gather.pending > 1 or rank == 1, "the buckets' gathers in flight"
    depths.clear()
    model(x)
    opt.close()
    return depths


def test_off_cuda_the_first_read_waits_for_every_gather_and_the_guard_goes(pools):
    for depths in pools[2].run(first_read_waits_for_all_worker):
        assert depths == [1, 0, 0, 0], depths  # pushed at the first Linear, popped at the second's call


def test_the_delay_exposes_a_stale_read_without_the_guard(pools):
    current = pools[2].run(overlapped_reads_worker, "clone", False)
    assert current[0] is False  # rank 0 read before rank 1's slices arrived


def training_worker(overlap: bool, steps: int = 4) -> list[torch.Tensor]:
    """Train TinyNet a few steps, evaluating and stepping an EMA between steps; the final params."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=0.05), bucket_size_mb=SMALL_BUCKETS_MB,
                                     overlap_param_gather=overlap)
    ema = [p.detach().clone() for p in model.parameters()]
    for step in range(steps):
        x, y = batch(rank, step)
        loss_fn(model, x, y).backward()
        opt.step()
        model.zero_grad()
        opt.zero_grad()
        {p: p.shape for p in model.parameters()}  # metadata only: no wait
        pending = opt._gather.pending
        torch._foreach_lerp_(ema, [p.detach() for p in model.parameters()], 0.5)
        with torch.no_grad():
            F.cross_entropy(model(x).reshape(-1, model.head.out_features), y.reshape(-1))
        assert (pending > 0) == overlap, f"{pending} gathers in flight after step() with overlap_param_gather={overlap}"
    result = [p.detach().clone() for p in model.parameters()] + ema
    opt.close()
    assert not compat.function_mode_stack(), "the guard stayed on the mode stack"
    return result


def test_overlapped_training_equals_waiting_in_step(pools):
    overlapped = pools[2].run(training_worker, True)
    waited = pools[2].run(training_worker, False)
    for a, b in zip(overlapped, waited):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def compiled_training_worker(overlap: bool, how: str, steps: int = 4) -> tuple[list[torch.Tensor], int, int]:
    """Train TinyNet compiled (``how``: ``torch.compile(model)``, ``model.compile()``, or a compiled function calling the model),
    a compiled frozen teacher run first after each ``step()`` (not before the function, which then comes first): (the final
    params, how many compiled graphs ran, how many were compiled)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model, teacher = TinyNet(), TinyNet().requires_grad_(False)
    ran, compiled = [0], [0]

    def backend(graph, example_inputs):  # runs the captured graph as it is, counting
        compiled[0] += 1

        def run(*args):
            ran[0] += 1
            return graph.forward(*args)

        return run

    if how == "wrapper":
        student = torch.compile(model, backend=backend)
    elif how == "function":
        student = torch.compile(lambda x, use_branch=True: model(x[:, :], use_branch=use_branch), backend=backend)
    else:
        model.compile(backend=backend)
        student = model
    teacher = torch.compile(teacher, backend=backend)
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=0.05), bucket_size_mb=SMALL_BUCKETS_MB,
                                     overlap_param_gather=overlap)
    for step in range(steps):
        x, y = batch(rank, step)
        if how != "function":
            with torch.no_grad():
                teacher(x)
        loss_fn(student, x, y).backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    torch._dynamo.reset()
    return [p.detach().clone() for p in model.parameters()], ran[0], compiled[0]


@pytest.mark.parametrize("how", ["wrapper", "in_place"])
def test_a_compiled_model_runs_compiled_with_the_gathers_in_flight(pools, how):
    # The guard stayed on the mode stack into the compiled frame (off CUDA the gathers rarely finish by the next forward):
    # Dynamo broke the graph at each wait and recompiled as the mode came and went, until it fell back to eager for good.
    overlapped = pools[2].run(compiled_training_worker, True, how)
    waited = pools[2].run(compiled_training_worker, False, how)
    for (params, ran, compiled), (expected, ran_waited, compiled_waited) in zip(overlapped, waited):
        assert all(torch.equal(a, b) for a, b in zip(params, expected))
        assert (ran, compiled) == (ran_waited, compiled_waited), ((ran, compiled), (ran_waited, compiled_waited))


def test_a_compiled_function_calling_the_model_compiles_once_with_the_gathers_in_flight(pools):
    # The guard, traced in the function, looked up each argument's id: Dynamo tied the code to the batch's identity and
    # recompiled for every batch (10 graphs in 8 steps, 5 in 3) until its recompile limit, then ran the frame eagerly.
    few = pools[2].run(compiled_training_worker, True, "function", 3)
    many = pools[2].run(compiled_training_worker, True, "function", 8)
    waited = pools[2].run(compiled_training_worker, False, "function", 8)
    for (_, _, compiled_in_3), (params, _, compiled_in_8), (expected, _, _) in zip(few, many, waited):
        assert all(torch.equal(a, b) for a, b in zip(params, expected))
        assert compiled_in_8 == compiled_in_3, (compiled_in_3, compiled_in_8)


def other_mode_worker() -> tuple[int, int]:
    """step() inside another torch function mode waits for its gathers (the guard cannot be pushed)."""
    rank = dist.get_rank()
    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model)), bucket_size_mb=SMALL_BUCKETS_MB)
    loss_fn(model, *batch(rank, 0)).backward()
    with torch.device("cpu"):  # a TorchFunctionMode
        opt.step()
        pending = opt._gather.pending
        depth = len(compat.function_mode_stack())
    opt.close()
    return pending, depth


def test_step_inside_another_mode_waits_for_its_gathers(pools):
    assert pools[2].run(other_mode_worker) == [(0, 1), (0, 1)]


def thread_worker() -> list[bool]:
    """Each iteration steps and reads in a new thread (thread ids are reused); the main thread waits in between."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=0.1), bucket_size_mb=SMALL_BUCKETS_MB)
    reads: list[list[torch.Tensor]] = []
    current = []

    def step_and_read(step: int) -> None:  # ends with the guard still on its own stack
        loss_fn(model, *batch(rank, step)).backward()
        with _delayed_all_gathers(DELAY_S if rank == 1 else 0.0):
            opt.step()
        reads.append([p.detach().clone() for p in model.parameters()])

    for step in range(3):
        thread = threading.Thread(target=step_and_read, args=(step,))
        thread.start()
        thread.join()
        opt.wait_params()
        current.append(all(torch.equal(a, p) for a, p in zip(reads[-1], model.parameters())))
    opt.close()
    return current


def test_a_new_thread_that_steps_is_guarded_too(pools):
    assert pools[2].run(thread_worker) == [[True] * 3, [True] * 3]


class _NcclLikeWork:
    """A collective handle with NCCL's wait semantics: ``wait()`` orders the current stream after
    the collective and returns at once; ``is_completed()`` turns true only when the device is done."""

    def __init__(self, streams: list[str]) -> None:
        self.streams = streams  # the simulated current stream, last element
        self.waited_on: list[str] = []
        self.done = False

    def wait(self, timeout=None) -> bool:
        self.waited_on.append(self.streams[-1])
        return True

    def is_completed(self) -> bool:
        return self.done


def _unwatch(gathers: param_gather.ParamGather) -> None:
    """Drop a test's simulated gathers from the guard and take the guard off the mode stack."""
    gathers._pending.clear()
    gathers._unsettled.clear()
    param_gather._GUARD._waiting.clear()
    param_gather.pop_guard_if_done()


def test_a_gather_waited_for_on_a_side_stream_is_waited_for_again_on_the_launch_stream(monkeypatch):
    # On CUDA a wait is a fact about one stream. An EMA under torch.cuda.stream(side) touching a param
    # first must not settle the gather for step()'s stream, which the next forward runs on. No GPU
    # here: the streams are names and the handle has NCCL's semantics (the real thing needs 2 GPUs).
    streams = ["launch"]
    monkeypatch.setattr(param_gather, "_current_stream", lambda device: types.SimpleNamespace(name=streams[-1], device=device))
    gathers = param_gather.ParamGather(group=None, timeout=None, overlap=True)
    weight, other = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    first, second = _NcclLikeWork(streams), _NcclLikeWork(streams)
    launched = param_gather._current_stream(weight.device)
    gathers._pending += [param_gather.BucketGather(first, (weight,), launched), param_gather.BucketGather(second, (other,), launched)]
    assert param_gather._GUARD.watch(gathers)
    try:
        streams.append("side")
        weight.clone()  # the EMA's read, on the side stream
        assert first.waited_on == ["side"] and gathers.pending == 2
        weight.clone()  # still not waited for on the launch stream: waits again
        assert first.waited_on == ["side", "side"]
        streams.pop()
        weight * 2  # the next forward, on the launch stream
        assert first.waited_on == ["side", "side", "launch"] and gathers.pending == 1
        weight * 2  # settled: no more waits
        assert first.waited_on == ["side", "side", "launch"]
        streams.append("side")
        other.clone()
        second.done = True  # the device finished it: retired without a wait on the launch stream
        param_gather.pop_guard_if_done()
        assert gathers.pending == 0 and second.waited_on == ["side"]
        assert param_gather._GUARD not in compat.function_mode_stack()
    finally:
        _unwatch(gathers)


class IndexesChildren(torch.nn.Module):
    """A parent whose forward reads its children's weights itself (``F.linear(h, layer.weight)``), not through their forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(13, 29)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(29, 29) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for layer in self.layers:
            h = torch.tanh(F.linear(h, layer.weight, layer.bias))
        return h


def step_then_read_worker(kind: str) -> list[float]:
    """Train 4 steps, each followed, with rank 1's gathers delayed, by what user code does between steps; per step, the
    largest difference between what a forward read right after ``step()`` and what it reads after ``wait_params()``.

    ``"transformer_eval"``: validation of an ``nn.TransformerEncoder`` under ``model.eval()`` and ``no_grad``, whose
    layers take a fused fast path (``torch._transformer_encoder_layer_fwd``) when no torch-function mode is active, one
    that reads the layer's sub-modules' weights inside the layer. ``"log_then_forward"``: one param read after the
    first step only (``if step % 100 == 0: log(p.norm())``), then a forward whose parent indexes its children's weights
    (``F.linear(h, layer.weight)``). Waits per module call, learned from the first forward after a step (a design tried
    and withdrawn), read stale params in the first case (the fast path is taken only once the mode is off) and, in a
    helper's probe with its own model, in the second (the log read had completed every gather, so the first forward
    learned nothing); the guard keeps both current."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    if kind == "transformer_eval":
        model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2,
                                            enable_nested_tensor=False)
        x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(rank))
    else:
        model = IndexesChildren()
        x = torch.randn(4, 13, generator=torch.Generator().manual_seed(rank))
    forward = model

    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), bucket_size_mb=SMALL_BUCKETS_MB)
    differences = []
    for step in range(4):
        model.train()
        forward(x).square().mean().backward()
        with _delayed_gathers(EACH_DELAY_S if rank == 1 else 0.0):  # each launch late: buckets arrive one by one
            opt.step()
        opt.zero_grad()
        model.eval()
        with torch.no_grad():
            if kind == "log_then_forward" and step == 0:
                model.layers[-1].weight.norm()
            out = forward(x)
        opt.wait_params()
        with torch.no_grad():
            differences.append(float((out - forward(x)).abs().max()))
    opt.close()
    return differences


@pytest.mark.parametrize("kind", ["transformer_eval", "log_then_forward"])
def test_forwards_after_every_step_read_current_params(pools, kind):
    for differences in pools[2].run(step_then_read_worker, kind):
        # (under the guard the encoder takes its slow path, the reference after wait_params() its fused one: rounding apart;
        # a stale read is off by about 1)
        assert all(d < 1e-5 for d in differences), differences


def test_a_compiled_module_called_on_a_side_stream_settles_every_gather_on_its_launch_stream(monkeypatch):
    # A compiled module (a teacher under torch.cuda.stream(side)) waits for every gather on its stream and on the launch
    # stream, which the next forward runs on, so the guard leaves before its frame: else it stayed, unsettled, into it.
    streams = ["launch"]
    monkeypatch.setattr(param_gather, "_current_stream", lambda device: types.SimpleNamespace(name=streams[-1], device=device))

    @contextlib.contextmanager
    def use_stream(stream):
        streams.append(stream.name)
        yield
        streams.pop()

    monkeypatch.setattr(param_gather, "_use_stream", use_stream)
    gathers = param_gather.ParamGather(group=None, timeout=None, overlap=True)
    weight = torch.nn.Parameter(torch.ones(3))
    work = _NcclLikeWork(streams)
    gathers._pending.append(param_gather.BucketGather(work, (weight,), param_gather._current_stream(weight.device)))
    assert param_gather._GUARD.watch(gathers)
    teacher = torch.nn.Linear(2, 2)
    teacher.compile(backend="eager")
    try:
        streams.append("side")
        param_gather._GUARD._before_module_call(teacher, ())
        assert work.waited_on[0] == "side" and work.waited_on[-1] == "launch" and gathers.pending == 0
        assert param_gather._GUARD not in compat.function_mode_stack()
    finally:
        _unwatch(gathers)
