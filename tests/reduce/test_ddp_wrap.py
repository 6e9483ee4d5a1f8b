"""A model also wrapped in DistributedDataParallel (HF Trainer's, accelerate's and Lightning's
default): one reduction, no more memory or traffic than zeroshard alone, DDP's own options trained
bitwise like DDP alone or refused by name, and DDP back to itself once the optimizer is closed."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import os
import socket
import struct
import sys
import time

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import VOCAB, TinyNet, average_grads, batch, loss_fn, param_groups
from rank_pool import RankPool
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard

BUCKET_MB = 100 * 4 / 2**20  # several buckets in TinyNet


# -- measuring: bytes sent and memory, per rank and step ------------------------------------------

TCP_INFO_SIZE = 232  # sizeof(struct tcp_info), Linux >= 5.5 (include/uapi/linux/tcp.h)
TCPI_BYTES_ACKED = 120  # offset of __u64 tcpi_bytes_acked (RFC 4898 tcpEStatsAppHCThruOctetsAcked)
M_MMAP_THRESHOLD = -3  # mallopt parameter (glibc malloc.h)
MLP_DIMS = (1024, 2048, 2048, 1024)  # 8.4M fp32 params (32 MiB), no module buffers
WARMUP_STEPS, MEASURED_STEPS = 1, 3


def tcp_bytes_sent() -> int:
    """Bytes this process has sent over its open TCP sockets that the peers acknowledged, per the kernel.

    gloo's pairs (and the TCPStore) are TCP connections over loopback, so the kernel's own count
    per socket (``getsockopt(TCP_INFO)``'s ``tcpi_bytes_acked``) measures what a rank sent, whoever
    sent it: zeroshard, DDP's reducer, DDP's buffer broadcasts, a barrier. It is independent of
    torch's and gloo's bookkeeping, covers only this process (unlike the machine-wide
    ``psutil.net_io_counters``, which other processes' traffic would pollute), and on loopback,
    with no loss, acknowledged equals sent once a transfer is over. Every socket in
    ``/proc/self/fd`` is read through a duplicate of its descriptor (closing it leaves the original
    open); sockets that are not TCP (the rank pool's Unix pipes) are skipped.
    """
    total = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:  # closed since listed
            continue
        with sock:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_SIZE)
                total += struct.unpack_from("Q", info, TCPI_BYTES_ACKED)[0]
    return total


def fix_malloc() -> None:
    """Make RSS count the live tensors: glibc serves every allocation >= 64 KiB by its own mmap, returned when freed.

    With glibc's default dynamic threshold, freeing a large block raises the threshold to its
    size, and later blocks come from arenas that keep freed pages resident: RSS growth of the same
    run then varied by 60 MiB from run to run (measured). Setting the threshold fixes it and turns
    off the dynamic adjustment (mallopt(3)). Only this module's own rank pool runs with it.
    """
    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024) == 1
    gc.collect()
    libc.malloc_trim(0)


def known_transfer_worker() -> int:
    """Bytes counted while rank 0 sends 1 MiB to rank 1 (and both pass a barrier)."""
    before = tcp_bytes_sent()
    payload = torch.zeros(2**18)  # 1 MiB of fp32
    if dist.get_rank() == 0:
        dist.send(payload, 1)
    else:
        dist.recv(payload, 0)
    dist.barrier()
    return tcp_bytes_sent() - before


def memory_worker(stage: int, ddp: str | None) -> dict[str, float]:
    """Per rank: bytes sent per step, and RSS / address-space growth, for one way of wrapping the model.

    ``ddp``: ``None`` (zeroshard alone), ``"before"`` (DDP with its defaults built before the
    optimizer: found at construction) or ``"after"`` (DDP with ``find_unused_parameters=True``,
    HF Trainer's default, built after it, as Trainer and accelerate do: found at the first backward,
    which DDP reduces too). Memory is counted from before the model is built to after each of
    the measured steps (the largest); bytes over the measured steps, after the warm-up step (DDP
    broadcasts the params once when built, and an "after" DDP reduces the first backward).
    """
    fix_malloc()
    process = psutil.Process()
    rss0, vms0 = process.memory_info().rss, process.memory_info().vms
    torch.manual_seed(0)
    layers = [m for i in range(len(MLP_DIMS) - 1) for m in (nn.Linear(MLP_DIMS[i], MLP_DIMS[i + 1]), nn.GELU())][:-1]
    model = nn.Sequential(*layers)
    net = DDP(model) if ddp == "before" else model
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), stage=stage)
    if ddp == "after":
        net = DDP(model, find_unused_parameters=True)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(8, MLP_DIMS[0], generator=g), torch.randn(8, MLP_DIMS[-1], generator=g)
    rss = vms = 0
    for step in range(WARMUP_STEPS + MEASURED_STEPS):
        if step == WARMUP_STEPS:
            dist.barrier()
            sent = tcp_bytes_sent()
        ((net(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step >= WARMUP_STEPS:
            opt.wait_params()  # measured at rest: no all-gather in flight
            info = process.memory_info()
            rss, vms = max(rss, info.rss - rss0), max(vms, info.vms - vms0)
    dist.barrier()  # every byte of the last step acknowledged
    sent = tcp_bytes_sent() - sent
    opt.close()
    return {"sent_per_step": sent / MEASURED_STEPS, "rss": rss, "vms": vms}


LINUX_ONLY = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/fd and TCP_INFO, sets glibc's malloc")


@pytest.fixture(scope="module")
def memory_pool():
    """Rank processes of their own (``fix_malloc`` stays with them), warmed up by one discarded run."""
    pool = RankPool(2)
    pool.run(memory_worker, 2, None)  # one-time costs (thread pools, gloo buffers) out of the measurement
    yield pool
    pool.close()


@LINUX_ONLY
def test_tcp_count_measures_a_known_transfer(memory_pool):
    sender, receiver = memory_pool.run(known_transfer_worker)
    assert 2**20 <= sender <= 2**20 + 16 * 1024, sender
    assert receiver <= 16 * 1024, receiver


@LINUX_ONLY
@pytest.mark.parametrize("stage", [1, 2])
def test_ddp_wrapper_costs_no_bytes_or_memory(memory_pool, stage):
    """Per rank: bytes sent per step, RSS and address-space growth inside DDP <= 1.05x zeroshard alone.

    The address space counts what is allocated whether written or not, as device memory would
    on a GPU. Measured before zeroshard released DDP's reducer (rank 0; alone / DDP before / DDP
    after): stage 2 RSS +80.7 / +80.8 / +112.8 MiB, address space +80.2 / +112.4 / +112.6 MiB;
    stage 1 RSS +113.0 / +113.5 / +144.9 MiB; 48.04 MiB sent per step in every case.
    """
    alone, before, after = (memory_pool.run(memory_worker, stage, ddp) for ddp in (None, "before", "after"))
    mib = 2**20
    for rank in range(2):
        line = " | ".join(f"{name}: sent {r[rank]['sent_per_step'] / mib:.2f} MiB/step, RSS +{r[rank]['rss'] / mib:.1f} MiB, "
                          f"address space +{r[rank]['vms'] / mib:.1f} MiB"
                          for name, r in (("alone", alone), ("DDP before", before), ("DDP after", after)))
        print(f"stage {stage} rank {rank}: {line}")
    for name, wrapped in (("DDP built before the optimizer", before), ("DDP built after it", after)):
        for rank in range(2):
            for what in ("sent_per_step", "rss", "vms"):
                assert wrapped[rank][what] <= 1.05 * alone[rank][what], (name, rank, what, wrapped[rank][what] / 2**20, alone[rank][what] / 2**20)


# -- DDP's options: bitwise as DDP alone, before and after close() --------------------------------

VARIANTS = {
    "defaults": {},
    "find_unused_parameters": {"find_unused_parameters": True},
    "static_graph": {"static_graph": True},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
}


def counting_hook(counter, bucket):  # no annotations: DDP checks them, and this module's are strings
    """DDP's default reduction (``allreduce_hook``), counting the buckets it reduces in ``counter[0]``."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    counter[0] += 1
    return allreduce_hook(None, bucket)


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters())) and all(
        torch.equal(x, y) for x, y in zip(a.buffers(), b.buffers()))


def _assert_on_every_rank(ok: bool, message: str) -> None:
    """Assert on every rank when one rank's check fails (a rank raising alone would leave the other in a collective)."""
    flag = torch.tensor([float(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    assert flag.item() == 1.0, f"{message} (on rank {dist.get_rank()}: {'ok' if ok else 'differs'})"


def _tiny_loss(net: nn.Module, step: int, micro: int) -> torch.Tensor:
    return loss_fn(net, *batch(dist.get_rank(), step, micro))


def _ddp_pairs(stage: int, when: str, net_class=TinyNet, params=param_groups, wrap=DDP, wrap_ref=DDP) -> list[tuple[nn.Module, torch.optim.Optimizer]]:
    """``[(DDP alone, AdamW), (the same model wrapped by wrap(), ShardedOptimizer(AdamW))]``, same seed; the
    wrapper built before the optimizer (``when="before"``) or after it."""
    torch.manual_seed(0)
    ref_model = net_class()
    model = copy.deepcopy(ref_model)
    ref = wrap_ref(ref_model)
    wrapped = wrap(model) if when == "before" else None
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(params(model), lr=1e-2, foreach=False), stage=stage, bucket_size_mb=BUCKET_MB)
    wrapped = wrapped or wrap(model)
    return [(ref, torch.optim.AdamW(params(ref_model), lr=1e-2, foreach=False)), (wrapped, opt)]


def _train_side_by_side(pairs, steps: range, accumulate: bool, what: str, loss=_tiny_loss) -> None:
    """Train each (DDP, optimizer) pair alike, a ``no_sync()`` micro-step first when ``accumulate``; equal after every step.

    Params and module buffers are compared bitwise; ``loss(net, step, micro)`` gives each micro-step's loss.

    With ``static_graph=True`` the first step of ``steps`` has no such micro-step: DDP alone
    cannot run ``no_sync()`` in a static graph's first iteration (its reducer fails an internal
    assert), and after ``opt.close()`` DDP has a new reducer, whose first iteration it is.
    """
    for step in steps:
        for net, opt in pairs:
            if accumulate and not (net.static_graph and step == steps[0]):
                with net.no_sync():  # accumulation as HF Trainer and accelerate do it
                    loss(net, step, 1).backward()
            loss(net, step, 0).backward()
            opt.step()
            net.zero_grad()
        _assert_on_every_rank(_same(pairs[0][0].module, pairs[1][0].module), f"step {step}: params differ from DDP alone {what}")


def ddp_option_worker(stage: int, when: str, variant: str, accumulate: bool) -> dict:
    """Zeroshard inside DDP(**VARIANTS[variant]) against DDP alone, then DDP alone again after opt.close()."""
    kwargs = VARIANTS[variant]
    counter = [0]

    def wrap(model: nn.Module) -> DDP:
        wrapped = DDP(model, **kwargs)
        wrapped.register_comm_hook(counter, counting_hook)
        return wrapped

    pairs = _ddp_pairs(stage, when, wrap=wrap, wrap_ref=lambda model: DDP(model, **kwargs))
    wrapped, opt = pairs[1]
    what = f"(stage {stage}, DDP {when}, {variant}, accumulate={accumulate})"
    _train_side_by_side(pairs, range(1), accumulate, what)
    after_first_step = counter[0]
    _train_side_by_side(pairs, range(1, 4), accumulate, what)
    result = {"after_first_step": after_first_step, "owned": counter[0], "reducer": type(wrapped.reducer).__name__}
    opt.close()  # DDP gets its reducer and its reduction back: plain AdamW on both sides from here
    pairs = [(net, torch.optim.AdamW(param_groups(net.module), lr=1e-2, foreach=False)) for net, _ in pairs]
    _train_side_by_side(pairs, range(4, 7), accumulate, what + " after opt.close()")
    result["closed"] = counter[0]
    return result


@pytest.mark.parametrize("accumulate", [True, False], ids=["no_sync", "plain"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("stage", [1, 2])
def test_ddp_options_train_like_ddp_alone_and_after_close(pools, stage, when, variant, accumulate):
    for result in pools[2].run(ddp_option_worker, stage, when, variant, accumulate):
        # While the optimizer owns the params DDP reduces nothing, also a wrapper built after the
        # optimizer (adopted before its first forward), and its reducer is released; once closed,
        # DDP reduces with its own hook again.
        assert result["after_first_step"] == 0, result
        assert result["owned"] == 0, result
        assert result["reducer"] == "ReleasedReducer", result
        assert result["closed"] > result["owned"], result


# -- module buffers, DDP built mid-training, frameworks calling DDP's reducer -----------------------


class NormNet(nn.Module):
    """A model with module buffers (BatchNorm running statistics), which DDP broadcasts from rank 0 before each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(6, 10), nn.BatchNorm1d(10), nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def _norm_loss(net: nn.Module, step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())  # other data, other statistics per rank
    x = torch.randn(5, 6, generator=g) * (1 + dist.get_rank())
    return net(x).square().mean()


def buffers_worker(stage: int, when: str) -> None:
    pairs = _ddp_pairs(stage, when, net_class=NormNet, params=lambda model: model.parameters())
    _train_side_by_side(pairs, range(4), True, f"(stage {stage}, DDP {when}, BatchNorm)", loss=_norm_loss)


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("stage", [1, 2])
def test_module_buffers_are_broadcast_as_by_ddp_alone(pools, stage, when):
    # DDP broadcasts rank 0's buffers before each forward that follows a synchronizing one.
    pools[2].run(buffers_worker, stage, when)


def wrapped_mid_training_worker(stage: int, find_unused_parameters: bool) -> None:
    """The model wrapped in DDP after two steps of training (a DDP found at a later backward)."""
    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    ref = DDP(ref_model, find_unused_parameters=find_unused_parameters)
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2, foreach=False), stage=stage, bucket_size_mb=BUCKET_MB)
    ref_opt = torch.optim.AdamW(param_groups(ref_model), lr=1e-2, foreach=False)
    for step in range(2):
        for net, o in ((ref, ref_opt), (model, opt)):
            _tiny_loss(net, step, 0).backward()
            o.step()
            net.zero_grad()
    wrapped = DDP(model, find_unused_parameters=find_unused_parameters)
    pairs = [(ref, ref_opt), (wrapped, opt)]
    _train_side_by_side(pairs, range(2, 5), True, f"(stage {stage}, wrapped after two steps)")
    assert type(wrapped.reducer).__name__ == "ReleasedReducer"


@pytest.mark.parametrize("find_unused_parameters", [False, True])
@pytest.mark.parametrize("stage", [1, 2])
def test_model_wrapped_after_training_started_trains_like_ddp(pools, stage, find_unused_parameters):
    pools[2].run(wrapped_mid_training_worker, stage, find_unused_parameters)


@contextlib.contextmanager
def trigger_sync_in_backward(model: DDP):
    """accelerate's ``Accelerator.trigger_sync_in_backward`` (accelerate/accelerator.py): have the next backward
    reduce although its forward ran under ``no_sync()``, through DDP's ``reducer.prepare_for_backward``."""
    old = model.require_backward_grad_sync, model.require_forward_param_sync
    model.require_backward_grad_sync = model.require_forward_param_sync = True
    model.reducer.prepare_for_backward([])
    try:
        yield
    finally:
        model.require_backward_grad_sync, model.require_forward_param_sync = old


def trigger_sync_worker(stage: int, when: str) -> None:
    """A micro-step under no_sync(), then one whose forward runs under no_sync() and whose backward is made to reduce."""
    pairs = _ddp_pairs(stage, when)
    ref, model = pairs[0][0], pairs[1][0].module
    for step in range(3):
        for net, o in pairs:
            with net.no_sync():
                _tiny_loss(net, step, 1).backward()
                last = _tiny_loss(net, step, 0)
            sent = tcp_bytes_sent()
            with trigger_sync_in_backward(net):
                last.backward()
            # The gradients are reduced in this backward (not only at step(), which would give the same numbers).
            # The kernel counts bytes once the peer acknowledges them, which can trail the collective's end.
            deadline = time.monotonic() + 2.0
            while tcp_bytes_sent() - sent <= 2**10 and time.monotonic() < deadline:
                time.sleep(0.01)
            _assert_on_every_rank(tcp_bytes_sent() - sent > 2**10, f"step {step}: nothing sent in the triggered backward")
            o.step()
            net.zero_grad()
        _assert_on_every_rank(_same(ref.module, model), f"step {step}: params differ from DDP alone (stage {stage}, DDP {when})")


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("stage", [1, 2])
def test_accelerate_trigger_sync_in_backward_is_followed(pools, stage, when):
    pools[2].run(trigger_sync_worker, stage, when)


# -- DDP options zeroshard cannot follow, and DDP's API while its reducer is released --------------


def _refusal(make_ddp, when: str = "before") -> str:
    """The error building the optimizer (``when="before"``) or the first backward (``"after"``) raises for ``make_ddp(model)``."""
    torch.manual_seed(0)
    model = TinyNet()
    ddp = make_ddp(model) if when == "before" else None
    try:
        opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), stage=2, bucket_size_mb=BUCKET_MB)
        ddp = ddp or make_ddp(model)
        _tiny_loss(ddp, 0, 0).backward()
    except RuntimeError as error:
        return str(error)
    opt.close()
    return ""


def _with_python_reducer(model: nn.Module) -> DDP:
    import torch._dynamo

    previous = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = "python_reducer"
    try:
        return DDP(model)
    finally:
        torch._dynamo.config.optimize_ddp = previous


def refusals_worker() -> dict[str, str]:
    from torch.nn.parallel.distributed import _MixedPrecision

    def delayed(m: nn.Module) -> DDP:
        return DDP(m, delay_all_reduce_named_params=[("fc1.bias", m.fc1.bias)], param_to_hook_all_reduce=m.fc2.weight)

    return {
        "mixed_precision": _refusal(lambda m: DDP(m, mixed_precision=_MixedPrecision(param_dtype=torch.float16))),
        "delay_all_reduce_named_params": _refusal(delayed),
        "delay_all_reduce_named_params, DDP built after": _refusal(delayed, "after"),
        "python_reducer": _refusal(_with_python_reducer),
    }


def test_ddp_options_zeroshard_cannot_follow_raise_naming_them(pools):
    for messages in pools[2].run(refusals_worker):
        for option, message in messages.items():
            assert option.split(",")[0] in message and "drop the DistributedDataParallel wrapper" in message, (option, message)


def released_api_worker() -> dict[str, str]:
    """DDP's own API while zeroshard owns the params: refused by name, or answered from what DDP held."""
    torch.manual_seed(0)
    model = TinyNet()
    ddp = DDP(model)
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), stage=2, bucket_size_mb=BUCKET_MB)
    answers = {"logging data": ddp._get_ddp_logging_data().get("module_name")}  # Lightning reads it at teardown
    with pytest.raises(RuntimeError) as error:
        ddp.register_comm_hook(None, lambda state, bucket: None)
    answers["register_comm_hook"] = str(error.value)
    opt.close()
    return answers


def test_ddp_api_while_the_reducer_is_released(pools):
    for answers in pools[2].run(released_api_worker):
        assert answers["logging data"] == "TinyNet"
        assert "DistributedDataParallel.logger._set_comm_hook_name" in answers["register_comm_hook"]
        assert "Call opt.close() first to give DDP its reducer back" in answers["register_comm_hook"]


def builtin_hook_worker(stage: int) -> None:
    """A built-in communication hook (which DDP records by name only) is registered again on the reducer given back."""
    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    ref, wrapped = DDP(ref_model), DDP(model)
    for net in (ref, wrapped):
        net._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2, foreach=False), stage=stage, bucket_size_mb=BUCKET_MB)
    opt.close()  # at once: DDP alone with its fp16-compressed reduction on both sides
    pairs = [(net, torch.optim.AdamW(param_groups(net.module), lr=1e-2, foreach=False)) for net in (ref, wrapped)]
    _train_side_by_side(pairs, range(3), True, "(built-in FP16_COMPRESS hook, after opt.close())")


@pytest.mark.parametrize("stage", [1, 2])
def test_builtin_comm_hook_is_given_back(pools, stage):
    pools[2].run(builtin_hook_worker, stage)


def two_optimizers_worker(stage: int) -> None:
    """Two optimizers over the two param groups of one DDP-wrapped model (e.g. Muon for matrices, AdamW for the rest)."""
    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    ref, wrapped = DDP(ref_model), DDP(model)
    ref_opts = [torch.optim.AdamW([group], lr=1e-2, foreach=False) for group in param_groups(ref_model)]
    opts = [zeroshard.ShardedOptimizer(torch.optim.AdamW([group], lr=1e-2, foreach=False), stage=stage, bucket_size_mb=BUCKET_MB)
            for group in param_groups(model)]

    class Both:
        def __init__(self, optimizers):
            self.optimizers = optimizers

        def step(self):
            for o in self.optimizers:
                o.step()

    _train_side_by_side([(ref, Both(ref_opts)), (wrapped, Both(opts))], range(3), True, f"(stage {stage}, two optimizers)")
    opts[0].close()
    assert type(wrapped.reducer).__name__ == "ReleasedReducer"  # the other one still reduces its params
    opts[1].close()
    pairs = [(net, torch.optim.AdamW(param_groups(net.module), lr=1e-2, foreach=False)) for net in (ref, wrapped)]
    _train_side_by_side(pairs, range(3, 5), True, f"(stage {stage}, after closing both)")


@pytest.mark.parametrize("stage", [1, 2])
def test_two_optimizers_over_one_ddp_wrapper(pools, stage):
    pools[2].run(two_optimizers_worker, stage)


def direct_forward_worker(stage: int, unused_everywhere: bool) -> tuple[float, str]:
    """A step, ``zero_grad(set_to_none=False)`` (zero ShardedGrads stay in ``.grad``), then DDP built around the model and
    ``ddp.forward(x)`` called directly (no forward hook: the wrapper is adopted at the first gradient, its C++ reducer armed)
    with ``b`` unused on rank 1 (or on every rank: its zeroed gradient is still a gradient, which moves AdamW's params); against
    torch AdamW on the all-reduced mean. The largest param difference, and the error of a second direct ``ddp.forward(x)``."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.ModuleDict(dict(a=nn.Linear(4, 4), b=nn.Linear(4, 4)))
    ref_model = copy.deepcopy(model)
    forward = lambda net, x, use_b: net["b"](net["a"](x)) if use_b else net["a"](x)  # noqa: E731
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=0.1)
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), stage=stage, collective_timeout_s=30)
    xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(2)]
    try:
        for net, optimizer in ((ref_model, ref_opt), (model, opt)):
            forward(net, xs[0], True).sum().backward()
            if net is ref_model:
                average_grads(net)
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        wrapped = DDP(model, find_unused_parameters=True)
        wrapped.module.forward = lambda x, use_b: forward(model, x, use_b)
        use_b = rank == 0 and not unused_everywhere
        wrapped.forward(xs[1], use_b).sum().backward()
        opt.step()
        forward(ref_model, xs[1], use_b).sum().backward()
        average_grads(ref_model)
        ref_opt.step()
        refused = ""
        try:  # now released, DDP's reducer cannot take the forward a direct call prepares
            wrapped.forward(xs[1], use_b)
        except RuntimeError as error:
            refused = str(error)
        return max(float((a - b).abs().max()) for a, b in zip(model.parameters(), ref_model.parameters())), refused
    finally:
        opt.close()


@pytest.mark.parametrize("unused_everywhere", [False, True])
def test_ddp_forward_called_directly_with_a_param_unused_on_some_ranks(pools, unused_everywhere):
    # Stage 1 (stage 2 leaves None in .grad, which DDP skips). Unused on rank 1: raised there alone (DDP's reducer copied into a
    # ShardedGrad's placeholder) and rank 0 hung in step(); unused everywhere: its zeroed gradient was dropped, params off by 0.07
    for difference, refused in pools[2].run(direct_forward_worker, 1, unused_everywhere):
        assert difference == 0.0
        assert "DistributedDataParallel.forward ran without its forward hooks (ddp.forward(x) called directly?)" in refused


def uncovered_worker(when: str) -> dict[str, str]:
    """DDP wraps TinyNet, built ``when`` (before or after the optimizers); a ShardedOptimizer holds every trainable param but
    fc2's, which a plain SGD steps (``"plain"``), a second ShardedOptimizer holds (``"second"``), or which are frozen
    (``"frozen"``), or which the second holds, fc2.bias frozen while both were built (``"second, unfrozen"``). Per case, what
    two training steps raise ("" for nothing) and whether the ranks' params stayed equal."""
    out = {}
    for case in ("plain", "second", "frozen", "second, unfrozen"):
        torch.manual_seed(0)
        model = TinyNet()
        ddp = DDP(model) if when == "before" else None
        if case == "frozen":
            model.fc2.requires_grad_(False)
        if case == "second, unfrozen":
            model.fc2.bias.requires_grad_(False)
        rest = [p for p in model.parameters() if all(p is not q for q in model.fc2.parameters())]
        opts = [zeroshard.ShardedOptimizer(torch.optim.AdamW(rest, lr=1e-2), bucket_size_mb=BUCKET_MB)]
        fc2 = list(model.fc2.parameters())
        if case == "plain":
            opts.append(torch.optim.SGD(fc2, lr=0.1))
        elif case.startswith("second"):
            opts.append(zeroshard.ShardedOptimizer(torch.optim.SGD(fc2, lr=0.1)))
        if case == "second, unfrozen":  # frozen while the optimizers were built: the second shards them at the first backward's end
            model.fc2.bias.requires_grad_(True)
        ddp = ddp or DDP(model)
        message = ""
        try:
            for step in range(2):
                _tiny_loss(ddp, step, 0).backward()
                for opt in opts:
                    opt.step()
                    opt.zero_grad()
        except RuntimeError as error:
            message = str(error)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        out[case] = (message, all(torch.equal(g, flat) for g in gathered))
        for opt in opts:
            if isinstance(opt, zeroshard.ShardedOptimizer):
                opt.close()
    return out


@pytest.mark.parametrize("when", ["before", "after"])
def test_ddp_wrapping_params_no_sharded_optimizer_holds_raises(pools, when):
    # zeroshard switches the wrapper's reduction off: a plain optimizer over the rest would have let the ranks drift apart
    for results in pools[2].run(uncovered_worker, when):
        message, _ = results["plain"]
        assert "DistributedDataParallel wraps 2 trainable param(s) that no ShardedOptimizer holds (['fc2.weight', 'fc2.bias'])" in message, message
        assert results["second"] == results["frozen"] == results["second, unfrozen"] == ("", True), results


class BlocksNet(nn.Module):
    """Repeated blocks in an ``nn.ModuleList``: what accelerate's ``compile_regions`` compiles one by one."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 13)
        self.blocks = nn.ModuleList(nn.Linear(13, 13) for _ in range(2))
        self.head = nn.Linear(13, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


def regional_compile_worker(stage: int) -> list[tuple[float, float]]:
    """accelerate's regional compilation (``TorchDynamoPlugin(use_regional_compilation=True)``; HF Trainer's ``torch_compile``
    with ``ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=1``) of a DDP built after the optimizer: ``compile_regions`` runs a
    shallow copy of the wrapper, sharing its hooks and reducer, the original kept alive beside it. Per step, torch's clip norm
    over the model's ``.grad`` after the backward, and DDP's; params equal after every step."""
    from accelerate.utils import compile_regions

    torch.manual_seed(0)
    ref_model = BlocksNet()
    model = copy.deepcopy(ref_model)
    ref, ref_opt = DDP(ref_model), torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False), stage=stage, bucket_size_mb=BUCKET_MB)
    wrapped = compile_regions(DDP(model), backend="eager")
    assert wrapped.__class__ is DDP and wrapped is not wrapped._orig_mod, "a copy of the wrapper, the original beside it"
    norms = []
    for step in range(3):
        x, y = batch(dist.get_rank(), step)
        for net in (ref, wrapped):
            F.cross_entropy(net(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        norms.append((float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)), float(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5))))
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
        assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(ref_model.parameters(), model.parameters())), f"step {step}"
    opt.close()
    return norms


@pytest.mark.parametrize("stage", [1, 2])
def test_a_shallow_copy_of_the_wrapper_as_regional_compilation_makes_is_reduced_by_zeroshard(pools, stage):
    # The original, adopted at the first backward without a forward, counted as DDP reducing it: .grad was None (stage 2) or
    # each rank's own (stage 1) after the first backward, so the first step's clip read 0.0 or a rank's own norm, silently.
    for norms in pools[2].run(regional_compile_worker, stage):
        assert all(abs(ours - ddps) <= 1e-5 * ddps for ours, ddps in norms), norms


def never_forwarded_trigger_worker(stage: int) -> float:
    """A DDP built after the optimizer whose forwards all bypass it (``ddp.module(x)``), with accelerate's
    ``trigger_sync_in_backward`` arming its reducer for the second of two backward passes: the largest param difference from
    DDP alone doing the same through its own forward."""
    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2, foreach=False), stage=stage, bucket_size_mb=BUCKET_MB)
    ref, ref_opt = DDP(ref_model), torch.optim.AdamW(param_groups(ref_model), lr=1e-2, foreach=False)
    ddp = DDP(model)
    for step in range(3):
        for wrapper, forward, o in ((ref, ref, ref_opt), (ddp, ddp.module, opt)):
            with wrapper.no_sync():
                first, second = _tiny_loss(forward, step, 0), _tiny_loss(forward, step, 1)
            first.backward()
            with trigger_sync_in_backward(wrapper):
                second.backward()
            o.step()
            o.zero_grad()
    opt.close()
    return max(float((a - b).abs().max()) for a, b in zip(ref_model.parameters(), model.parameters()))


@pytest.mark.parametrize("stage", [1, 2])
def test_a_wrapper_that_never_ran_a_forward_is_released_when_adopted(pools, stage):
    # It gets no say in whether DDP reduced the backward (regional compilation's original); its reducer, not released until
    # the next forward or step(), was armed by trigger_sync_in_backward and wrote into zeroshard's gradients (a crash).
    for off in pools[2].run(never_forwarded_trigger_worker, stage):
        assert off <= 1e-6, off
