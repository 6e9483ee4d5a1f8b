"""The torch.optim contract and the error paths of ShardedOptimizer, on gloo ranks."""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import pickle
import re

import pytest
import torch
import torch.distributed as dist
from models import TinyNet, batch, loss_fn, param_groups
from torch import nn

import zeroshard
from zeroshard import compat


def _adamw(model: nn.Module, **kwargs) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model), lr=1e-2, foreach=False, **kwargs)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x, y = batch(dist.get_rank(), step)
        loss_fn(model, x, y).backward()
        opt.step()
        model.zero_grad()


def test_not_initialized_raises_before_anything():
    assert not dist.is_initialized()
    model = TinyNet()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="process_group: torch.distributed is not initialized"):
        zeroshard.ShardedOptimizer(_adamw(model))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def bad_input_worker() -> list[str]:
    model = TinyNet()
    frozen = nn.Linear(3, 3).requires_grad_(False)
    stepped = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    stepped.param_groups[0]["params"][0].grad = torch.ones(2, 2)
    stepped.step()
    cases = [
        (TypeError, "must be a torch.optim.Optimizer instance, got Linear", lambda: zeroshard.ShardedOptimizer(nn.Linear(2, 2))),
        (TypeError, r"got generator: wrap the optimizer you build, ShardedOptimizer\(torch.optim.AdamW\(model.parameters\(\)",
         lambda: zeroshard.ShardedOptimizer(nn.Linear(2, 2).parameters())),  # ZeroRedundancyOptimizer's first argument
        (ValueError, r"stage=3 must be 1 or 2", lambda: zeroshard.ShardedOptimizer(_adamw(model), stage=3)),
        (ValueError, r"bucket_size_mb=0 must be", lambda: zeroshard.ShardedOptimizer(_adamw(model), bucket_size_mb=0)),
        (TypeError, r"reduce_dtype=torch.int32", lambda: zeroshard.ShardedOptimizer(_adamw(model), reduce_dtype=torch.int32)),
        (TypeError, r"process_group must be .* got str", lambda: zeroshard.ShardedOptimizer(_adamw(model), process_group="world")),
        (ValueError, r"none with requires_grad=True", lambda: zeroshard.ShardedOptimizer(torch.optim.AdamW(frozen.parameters()))),
        (ValueError, r"none with requires_grad=True", lambda: zeroshard.ShardedOptimizer(torch.optim.AdamW([{"params": []}]))),
        (ValueError, r"one device; got params on \['cpu', 'meta'\]",
         lambda: zeroshard.ShardedOptimizer(torch.optim.AdamW([nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, device="meta"))]))),
        (ValueError, r"sparse params are not supported", lambda: zeroshard.ShardedOptimizer(torch.optim.SGD([nn.Parameter(torch.eye(2).to_sparse())], lr=0.1))),
        (ValueError, r"already holds state for 1 params", lambda: zeroshard.ShardedOptimizer(stepped)),
        (TypeError, r"stage=True must be", lambda: zeroshard.ShardedOptimizer(_adamw(model), stage=True)),
        (TypeError, r"stage=2.0 must be", lambda: zeroshard.ShardedOptimizer(_adamw(model), stage=2.0)),
        (TypeError, r"overlap_comm='yes' must be a bool", lambda: zeroshard.ShardedOptimizer(_adamw(model), overlap_comm="yes")),
        (TypeError, r"overlap_param_gather='yes' must be True or False", lambda: zeroshard.ShardedOptimizer(_adamw(model), overlap_param_gather="yes")),
        (TypeError, r"max_grad_norm=True must be", lambda: zeroshard.ShardedOptimizer(_adamw(model), max_grad_norm=True)),
        (ValueError, r"loss_scale=inf must be", lambda: zeroshard.ShardedOptimizer(_adamw(model), loss_scale=float("inf"))),
        (ValueError, r"bucket_size_mb=inf must be a finite", lambda: zeroshard.ShardedOptimizer(_adamw(model), bucket_size_mb=float("inf"))),
        (TypeError, r"bucket_size_mb='25' must be", lambda: zeroshard.ShardedOptimizer(_adamw(model), bucket_size_mb="25")),
        (TypeError, r"collective_timeout_s='5' must be", lambda: zeroshard.ShardedOptimizer(_adamw(model), collective_timeout_s="5")),
        (ValueError, r"collective_timeout_s=0 must be", lambda: zeroshard.ShardedOptimizer(_adamw(model), collective_timeout_s=0)),
        (ValueError, r"param_groups\[0\]\['params'\]\[3\] \(shape \(29, 13\)\) is listed earlier in its param group too",
         lambda: zeroshard.ShardedOptimizer(torch.optim.AdamW([model.embed.weight, model.fc1.bias, model.fc1.weight, model.fc1.weight]))),
        (ValueError, r"param_groups\[0\]\['params'\]\[1\] \(shape \(4, 3\), stride \(0, 1\)\) has elements that share memory",  # trained as 12 values
         lambda: zeroshard.ShardedOptimizer(torch.optim.AdamW([nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3).expand(4, 3))]))),
        (ValueError, r"param_groups\[0\]\['params'\]\[0\] \(shape \(2, 3\)\) is on the meta device",
         lambda: zeroshard.ShardedOptimizer(torch.optim.AdamW(nn.Linear(3, 2, device="meta").parameters()))),
    ]
    for error, match, build in cases:
        with pytest.raises(error, match=match):
            build()
    opt = zeroshard.ShardedOptimizer(_adamw(model))
    for copied in (copy.deepcopy, copy.copy, pickle.dumps):  # pickle.dumps and torch.save(opt) wrote a file whose load failed
        with pytest.raises(TypeError, match=r"cannot be pickled or copied .* save its state with opt.state_dict\(\)"):
            copied(opt)
    with pytest.raises(TypeError, match="already a ShardedOptimizer"):
        zeroshard.ShardedOptimizer(opt)
    with pytest.raises(TypeError, match=r"AdamW is already wrapped by a ShardedOptimizer: its param_groups\[0\]\['params'\]\[0\] is a virtual parameter"):
        zeroshard.ShardedOptimizer(opt.optimizer)
    with pytest.raises(ValueError, match="already in another param group"):
        opt.add_param_group({"params": [model.fc1.weight]})
    assert len(opt.param_groups) == 2
    with pytest.raises(RuntimeError, match=r"use_joint_norm\(\) needs a clip_grad_norm_\(\) since the last step\(\)"):
        opt.use_joint_norm(1.0)
    return [c[1] for c in cases]


def test_bad_input_raises_before_any_collective(pools):
    # Every rank raises the same errors; a collective run by some ranks only would hang here.
    pools[2].run(bad_input_worker)


def groups_by_hand_worker(how: str, optimizer: str) -> str:
    """``param_groups`` edited by hand rather than through ``add_param_group``: params added, groups reordered, an entry replaced."""
    model = TinyNet()
    build = torch.optim.AdamW if optimizer == "AdamW" else functools.partial(torch.optim.SGD, momentum=0.9)
    trained = [p for name, p in model.named_parameters() if not name.startswith("branch")]
    opt = zeroshard.ShardedOptimizer(build([{"params": [p for p in trained if p.dim() > 1]}, {"params": [p for p in trained if p.dim() < 2],
                                                                                               "weight_decay": 0.0}], lr=1e-2), stage=2)
    loss_fn(model, *batch(dist.get_rank(), 0)).backward()
    opt.step()
    opt.zero_grad()
    if how == "append":
        opt.param_groups.append({**opt.defaults, "params": list(model.branch.parameters())})
    elif how == "extend":
        opt.param_groups[0]["params"].extend(model.branch.parameters())
    elif how == "reverse":  # AdamW stepped each group with the other's weight decay
        opt.param_groups.reverse()
    else:  # AdamW went on stepping the replaced entry
        opt.param_groups[0]["params"][0] = nn.Parameter(torch.zeros_like(opt.param_groups[0]["params"][0]))
    # add_param_group() after the edit raises too (it took the edited lists for zeroshard's before), nothing added
    with pytest.raises(ValueError, match="by hand|reordered"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(3))]})
    before = [p.detach().clone() for p in model.parameters()]
    loss_fn(model, *batch(dist.get_rank(), 1)).backward()
    with pytest.raises(ValueError) as raised:
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing stepped
    return str(raised.value)


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
def test_param_groups_edited_by_hand_raise_on_every_rank(pools, optimizer):
    # Before, with AdamW (zeroshard's update) the added params were never trained; with SGD (the wrapped optimizer's own
    # step) each rank stepped them with its own gradient, unaveraged: the ranks' weights drifted apart. No error either way.
    appended = pools[2].run(groups_by_hand_worker, "append", optimizer)
    assert appended[0] == appended[1] and "optimizer.param_groups has 3 groups, the ShardedOptimizer sharded 2" in appended[0]
    assert "add it with opt.add_param_group(group)" in appended[0]
    extended = pools[2].run(groups_by_hand_worker, "extend", optimizer)
    for message in extended:  # each rank's count: its own virtual params, and the 2 added
        found = re.search(r"param_groups\[0\]\['params'\] has (\d+) entries where zeroshard put (\d+)", message)
        assert found and int(found[1]) == int(found[2]) + 2, message
    for how, found in (("reverse", "in another order or group: param_groups reordered"), ("replace", "some of them others")):
        for message in pools[2].run(groups_by_hand_worker, how, optimizer):
            assert "param_groups[0]['params'] has" in message and found in message, message


def frozen_odd_dtypes_worker() -> bool:
    """A frozen integer and a frozen complex param in the optimizer's list (a lookup table, a fixed filter), as torch.optim
    takes them: trained as DDP + AdamW trains the rest, the frozen values untouched."""
    def build():
        torch.manual_seed(0)
        model = nn.Linear(4, 4)
        model.table = nn.Parameter(torch.arange(4), requires_grad=False)
        model.filter = nn.Parameter(torch.randn(3, dtype=torch.complex64), requires_grad=False)
        return model

    reference, model = build(), build()
    ddp = torch.nn.parallel.DistributedDataParallel(reference)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), stage=2)
    for step in range(2):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * dist.get_rank() + step))
        for m, o in ((ddp, plain), (model, opt)):
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
    return all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters())) and torch.equal(model.table, torch.arange(4))


def test_frozen_integer_and_complex_params_are_taken(pools):
    # Before, the constructor's check of the params' order took their norm: torch's "linalg.vector_norm: Expected a floating
    # point or complex tensor as input. Got Long" (and "dtype should be complex" for the complex one), naming no param.
    assert all(pools[2].run(frozen_odd_dtypes_worker))


def step_hooks_worker(optimizer: str) -> dict[str, int]:
    """Step hooks on the wrapped optimizer (registered before or after wrapping), on the ShardedOptimizer, and torch's global ones."""
    model = TinyNet()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2) if optimizer == "AdamW" else torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    calls: dict[str, int] = {}

    def count(what: str):
        return lambda o, args, kwargs: calls.update({f"{what} {type(o).__name__}": calls.get(f"{what} {type(o).__name__}", 0) + 1})

    inner.register_step_pre_hook(count("pre"))
    opt = zeroshard.ShardedOptimizer(inner)
    inner.register_step_post_hook(count("post"))
    opt.register_step_pre_hook(count("pre"))
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    handles = [register_optimizer_step_pre_hook(count("global pre")), register_optimizer_step_post_hook(count("global post"))]
    try:
        for step in range(3):
            loss_fn(model, *batch(dist.get_rank(), step)).backward()
            opt.step()
            opt.zero_grad()
    finally:
        for handle in handles:
            handle.remove()
    return calls


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
def test_step_hooks_of_the_wrapped_optimizer_run_once_and_global_ones_once(pools, optimizer):
    # Before: with AdamW (zeroshard's fused update) the wrapped optimizer's own hooks never ran; with SGD (its own step)
    # torch's global hooks ran twice per step, once for each optimizer (a global hook halving the gradients halved them twice).
    for calls in pools[2].run(step_hooks_worker, optimizer):
        assert calls == {f"pre {optimizer}": 3, f"post {optimizer}": 3, "pre ShardedOptimizer": 3, "global pre ShardedOptimizer": 3,
                         "global post ShardedOptimizer": 3}, calls


class MyAdamW(torch.optim.AdamW):
    """A user's subclass: zeroshard cannot know its update is still element-wise."""


def optimizer_kind_worker() -> None:
    model = TinyNet()
    matrices = [p for p in model.parameters() if p.dim() == 2]
    for name, build in {"LBFGS": lambda: torch.optim.LBFGS(model.parameters()), "SparseAdam": lambda: torch.optim.SparseAdam(matrices)}.items():
        for partition in (None, "flat", "param"):
            with pytest.raises(ValueError, match=rf"^{name} cannot be sharded: "):
                zeroshard.ShardedOptimizer(build(), partition=partition)
    shape_aware = {"Adafactor": lambda: torch.optim.Adafactor(model.parameters()), "Muon": lambda: torch.optim.Muon(matrices)}
    for name, build in shape_aware.items():
        for bad in ({"partition": "flat"}, {"assume_elementwise": True}):  # known not to be element-wise: no escape hatch
            with pytest.raises(ValueError, match=rf"^{name} is not element-wise: .*{next(iter(bad))}"):
                zeroshard.ShardedOptimizer(build(), **bad)
        opt = zeroshard.ShardedOptimizer(build())
        assert opt.partition == "param" and all(v.dim() == 2 for v in opt.param_groups[0]["params"] if name == "Muon")
        opt.close()
    # A param Muon cannot update raises at add_param_group on every rank (not at step() on its owner alone), nothing added.
    opt = zeroshard.ShardedOptimizer(torch.optim.Muon(matrices))
    with pytest.raises(ValueError, match=r"Muon cannot update param_groups\[1\]\['params'\]\[0\] \(shape \(29,\)\): .*2D"):
        opt.add_param_group({"params": [model.fc1.bias]})
    assert len(opt.param_groups) == 1
    opt.close()
    opt = zeroshard.ShardedOptimizer(MyAdamW(model.parameters()))  # not known to be element-wise: whole params, correct either way
    assert opt.partition == "param"
    opt.close()
    with pytest.raises(TypeError, match=r"assume_elementwise=1 must be a bool"):
        zeroshard.ShardedOptimizer(MyAdamW(model.parameters()), assume_elementwise=1)
    with pytest.raises(ValueError, match=r"partition='rows' must be None, 'flat' or 'param'"):
        zeroshard.ShardedOptimizer(MyAdamW(model.parameters()), partition="rows")
    with pytest.raises(ValueError, match=r"assume_elementwise=True asks for partition='flat', but partition='param' was given"):
        zeroshard.ShardedOptimizer(MyAdamW(model.parameters()), partition="param", assume_elementwise=True)
    for flat in ({"assume_elementwise": True}, {"partition": "flat"}):
        opt = zeroshard.ShardedOptimizer(MyAdamW(model.parameters()), **flat)
        assert opt.partition == "flat"
        opt.close()
    for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
                torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.ASGD, torch.optim.Rprop):
        opt = zeroshard.ShardedOptimizer(cls(model.parameters(), lr=0.01))
        assert opt.partition == "flat"
        opt.close()


def test_partition_follows_the_optimizer_kind(pools):
    pools[2].run(optimizer_kind_worker)


def mismatch_worker() -> str:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3 if dist.get_rank() == 0 else 5))
    try:
        zeroshard.ShardedOptimizer(torch.optim.AdamW(model.parameters()))
    except ValueError as error:
        return str(error)
    return "no error"


def test_shape_mismatch_across_ranks_names_rank_and_param(pools):
    messages = pools[2].run(mismatch_worker)
    for message in messages:
        assert "param_groups[0]['params'][2] on rank 1 is ((5, 4)," in message, message


def rank_mistake_worker(mistake: str) -> str:
    """A mistake in how rank 1 builds its optimizer (or, for ``"non-leaf"``, both): the construction error, or "no error"."""
    torch.manual_seed(0)  # the same model on every rank
    model, rank = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), dist.get_rank()
    process_group = None
    if mistake == "set order":  # as list(set(model.parameters())) may give: the two weights swapped on rank 1
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(params if rank == 0 else [params[2], params[1], params[0], params[3]])
    elif mistake == "frozen set order":  # the biases frozen, and swapped on rank 1 (the broadcast goes by position)
        params = list(model.parameters())
        for bias in params[1::2]:
            bias.requires_grad_(False)
        optimizer = torch.optim.AdamW(params if rank == 0 else [params[0], params[3], params[2], params[1]])
    elif mistake == "fresh init on rank 1":  # not a mistake: rank 0 loaded weights, the others rely on the broadcast
        with torch.no_grad():
            if rank == 0:
                model[0].bias.normal_()
            else:
                model[1].bias.zero_()  # its norm, rank 0's ... of no other param: other values, no reordering
        optimizer = torch.optim.AdamW(model.parameters())
    elif mistake == "lr":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3 * (rank + 1))
    elif mistake == "group split":  # the same params, in one group on rank 0 and in two on rank 1
        params = list(model.parameters())
        optimizer = torch.optim.AdamW([{"params": params}] if rank == 0 else [{"params": params[:1]}, {"params": params[1:]}])
    elif mistake == "frozen on rank 1":
        model[0].bias.requires_grad_(rank == 0)
        optimizer = torch.optim.AdamW(model.parameters())
    elif mistake == "extra param on rank 1":  # a param more at the end of rank 1's only group
        extra = [nn.Parameter(torch.zeros(3))] if rank == 1 else []
        optimizer = torch.optim.AdamW(list(model.parameters()) + extra)
    elif mistake == "not a member":
        process_group = dist.new_group([0])  # every rank calls new_group; rank 1 gets GroupMember.NON_GROUP_MEMBER
        optimizer = torch.optim.AdamW(model.parameters())
    else:  # "non-leaf": the result of an op put into param_groups (torch.optim refuses it only at its construction)
        optimizer = torch.optim.AdamW(model.parameters())
        if mistake == "non-leaf" or rank == 1:  # "non-leaf on rank 1": there only
            optimizer.param_groups[0]["params"][1] = model[0].bias * 1.0
    try:
        zeroshard.ShardedOptimizer(optimizer, process_group=process_group).close()
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(("mistake", "expected"), [
    ("lr", ["param_groups item param_groups[0]['lr'] on rank 1 is (0.002,), on rank 0 (0.001,)"] * 2),
    ("group split", ["differs: rank 1 has param_groups[1]['amsgrad'] (False,) there, rank 0 param_groups[0]['params'][1] ((4,),"] * 2),
    ("frozen on rank 1", ["param_groups item param_groups[0]['params'][1] on rank 1 is ((4,), 'torch.float32', 'frozen'), on rank 0 "
                          "((4,), 'torch.float32', 'trainable')"] * 2),
    ("extra param on rank 1", ["param_groups items, rank 0 has", "(the first one more, on rank 1: param_groups[0]['params'][4] "
                               "((3,), 'torch.float32', 'trainable'))"]),
    ("not a member", ["no error", "this process (global rank 1) is not a member of process_group"]),
    ("non-leaf", ["param_groups[0]['params'][1] (shape (4,)) is not a leaf tensor"] * 2),
    # Before, rank 0 waited in the constructor's next collective for good.
    ("non-leaf on rank 1", ["the ShardedOptimizer constructor: rank 1 refused a param (its error says more); every rank stops here",
                            "param_groups[0]['params'][1] (shape (4,)) is not a leaf tensor"]),
    ("set order", ["param_groups[0]['params'][0] on rank 1 holds the values param_groups[0]['params'][2] holds on rank 0 (shape (4, 4))"] * 2),
    ("frozen set order", ["param_groups[0]['params'][1] on rank 1 holds the values param_groups[0]['params'][3] holds on rank 0 (shape (4,))"] * 2),
    ("fresh init on rank 1", ["no error"] * 2),
])
def test_a_rank_built_differently_or_a_bad_param_raises_naming_it(pools, mistake, expected):
    # Settings differing by rank would update each rank's shard with its own (no error before: a silent mix of the two).
    for message, text in zip(pools[2].run(rank_mistake_worker, mistake, timeout=120), expected):
        assert text in message, message


def broadcast_worker() -> bool:
    torch.manual_seed(dist.get_rank())  # ranks start different
    model = TinyNet()
    zeroshard.ShardedOptimizer(_adamw(model))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.manual_seed(0)
    rank0 = torch.cat([p.detach().reshape(-1) for p in TinyNet().parameters()])
    return torch.equal(flat, rank0)


def test_params_broadcast_from_rank_0(pools):
    assert pools[2].run(broadcast_worker) == [True, True]


def contract_worker() -> None:
    torch.manual_seed(0)
    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(_adamw(model), stage=2)
    assert isinstance(opt, torch.optim.Optimizer)
    x, y = batch(dist.get_rank(), 0)

    def closure():
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss is not None and loss.requires_grad
    # param_groups is live: an lr written there is what the next step uses (0 => no change).
    for group in opt.param_groups:
        group["lr"] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    opt.step(closure)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # Step hooks registered through torch's API run.
    calls = []
    opt.register_step_post_hook(lambda *args: calls.append("post"))
    opt.step(closure)
    assert calls == ["post"]


def test_torch_optimizer_contract(pools):
    pools[2].run(contract_worker)


def memory_worker(stage: int) -> tuple[int, int, dict]:
    torch.manual_seed(0)
    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(_adamw(model), stage=stage, bucket_size_mb=100 * 4 / 2**20)
    _train(model, opt, range(1))
    usage = opt.memory_usage()
    moments = sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items() if k != "step")
    return moments, usage.device_bytes, usage.by_kind


@pytest.mark.parametrize("stage", [1, 2])
def test_memory_usage_shards_optimizer_state(pools, stage):
    results = pools[2].run(memory_worker, stage)
    model = TinyNet()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # Across ranks, exp_avg + exp_avg_sq cover every trainable element exactly once: 8 bytes each.
    assert sum(moments for moments, _, _ in results) == 8 * trainable
    for moments, device_bytes, by_kind in results:
        assert by_kind["optimizer_state"] >= moments
        assert device_bytes == sum(by_kind.values())
        assert by_kind["params"] >= 4 * trainable
        assert (by_kind["grads"] >= 4 * trainable) == (stage == 1)  # stage 2 keeps no full gradients at rest


def refresh_worker() -> bool:
    """bf16 params written outside the optimizer (model.load_state_dict) are not reverted by step()."""
    torch.manual_seed(0)
    model = TinyNet().to(torch.bfloat16)
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0))
    torch.manual_seed(7)
    pretrained = TinyNet().to(torch.bfloat16).state_dict()
    model.load_state_dict(pretrained)
    _train(model, opt, range(1))
    return all(torch.equal(model.state_dict()[k], v) for k, v in pretrained.items())


def test_master_weights_follow_params_loaded_after_construction(pools):
    assert pools[2].run(refresh_worker) == [True, True]


def sparse_grad_worker() -> None:
    model = nn.Embedding(5, 3, sparse=True)
    opt = zeroshard.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="sparse gradient"):
        model(torch.tensor([1, 2])).sum().backward()
    del opt


def test_sparse_gradient_is_refused(pools):
    pools[2].run(sparse_grad_worker)


def mesh_and_sgd_worker() -> bool:
    """A 1-D DeviceMesh works as process_group, and a non-Adam optimizer steps the shard."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model, ref = TinyNet(), TinyNet()
    ref.load_state_dict(model.state_dict())
    opt = zeroshard.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), process_group=mesh)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            grads = []
            for rank in range(dist.get_world_size()):  # the reference sees every rank's batch
                x, y = batch(rank, step)
                if m is ref:
                    grads.append(loss_fn(m, x, y))
            if m is ref:
                (sum(grads) / len(grads)).backward()
            else:
                x, y = batch(dist.get_rank(), step)
                loss_fn(m, x, y).backward()
            o.step()
            m.zero_grad()
    return all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(model.parameters(), ref.parameters()))


def test_device_mesh_and_sgd(pools):
    assert pools[2].run(mesh_and_sgd_worker) == [True, True]


def overlap_worker(stage: int, overlap_comm: bool) -> tuple[list[str], list[int | None]]:
    """Order of bucket reduce-scatters against the last gradient hook of backward; bytes of each .grad after backward."""
    from zeroshard.comm import collectives

    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(_adamw(model), stage=stage, overlap_comm=overlap_comm, bucket_size_mb=100 * 4 / 2**20)
    events: list[str] = []
    original = collectives.reduce_scatter

    def recording(*args, **kwargs):
        events.append("reduce_scatter")
        return original(*args, **kwargs)

    collectives.reduce_scatter = recording
    try:
        # The tied embedding's gradient is the last one ready (its hook runs after zeroshard's).
        model.embed.weight.register_post_accumulate_grad_hook(lambda p: events.append("last hook"))
        x, y = batch(dist.get_rank(), 0)
        loss_fn(model, x, y).backward()
    finally:
        collectives.reduce_scatter = original
    with compat.DisableTorchFunctionSubclass():  # a ShardedGrad's own storage, not the gradient it stands for
        grad_bytes = [p.grad.untyped_storage().nbytes() if p.grad is not None else None for p in model.parameters() if p.requires_grad]
    flat_kept = all(grads.flat is not None for grads in opt._reducer._grads)  # the flat grad buffer: stage 1's full local gradients
    opt.step()
    return events, grad_bytes, flat_kept


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("overlap_comm", [True, False])
def test_buckets_reduced_during_backward_and_stage2_frees_grads(pools, stage, overlap_comm):
    events, grad_bytes, full_kept = pools[2].run(overlap_worker, stage, overlap_comm)[0]
    last = events.index("last hook")
    assert events.count("reduce_scatter") >= 3, events
    if overlap_comm:  # buckets complete before the last gradient must already be on the wire
        assert events[0] == "reduce_scatter", events
    else:
        assert events[: last + 1] == ["last hook"], events
    # Once reduced, each .grad is a ShardedGrad with one element of storage; stage 1 keeps the full local
    # gradients in its flat grad buffer, stage 2 frees them.
    assert grad_bytes == [4] * len(grad_bytes), grad_bytes
    assert full_kept == (stage == 1)


def staging_bound_worker() -> tuple[int, int, int]:
    """Peak stage 2 gradient-buffer bytes seen during backward, one bucket's bytes, all gradients' bytes."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(8)])
    bucket_mb = 64 * 64 * 4 / 2**20  # one layer per bucket
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(model.parameters()), stage=2, bucket_size_mb=bucket_mb)
    peak = 0

    def record(_):
        nonlocal peak
        peak = max(peak, opt.memory_usage().by_kind["grads"])

    for layer in model:  # registered after zeroshard's hooks, so they see its buffers
        layer.weight.register_post_accumulate_grad_hook(record)
    for _ in range(2):
        model(torch.randn(4, 64)).sum().backward()
        record(None)  # after the end-of-backward reduction too
        opt.step()
    # The hooks keep ``opt`` alive (params -> hook -> opt) after this returns: leave nothing in flight,
    # or its gathers would keep the shared guard pushed for later tests in this process.
    opt.close()
    return peak, 64 * 64 * 4, 8 * 64 * 64 * 4


def test_stage2_gradient_buffers_stay_bounded_during_backward(pools):
    from zeroshard.reduce.bucket import MAX_BUCKETS_IN_FLIGHT

    for peak, bucket, everything in pools[2].run(staging_bound_worker):
        assert peak <= (MAX_BUCKETS_IN_FLIGHT + 1) * bucket < everything, (peak, bucket, everything)


def inner_step_worker(optimizer_name: str) -> tuple[str, bool]:
    """The wrapped optimizer's own step() after wrapping: (the error, whether the params stayed as they were)."""
    torch.manual_seed(0)
    model = TinyNet()
    inner = getattr(torch.optim, optimizer_name)(param_groups(model), lr=1e-2)
    opt = zeroshard.ShardedOptimizer(inner)
    loss_fn(model, *batch(dist.get_rank(), 0)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError) as error:
        inner.step()
    opt.step()  # the ShardedOptimizer's own step still runs the wrapped one (SGD: its step(); AdamW: the fused update)
    return str(error.value), not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("optimizer_name", ["AdamW", "SGD"])
def test_the_wrapped_optimizers_own_step_raises(pools, optimizer_name):
    # It would update this rank's shard alone, with no gather: the ranks' params would drift apart with no error.
    for message, stepped in pools[2].run(inner_step_worker, optimizer_name):
        assert f"{optimizer_name}.step() was called on the optimizer a ShardedOptimizer wraps" in message, message
        assert stepped


class ScaledSGD(torch.optim.SGD):
    """Keeps a per-param factor in a dict of its own, keyed by the params it was built with."""

    def __init__(self, params) -> None:
        params = list(params)
        super().__init__(params, lr=0.1)
        self.factor = {p: 0.5 for p in params}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] * self.factor[p])


def keyed_by_param_worker() -> str:
    """What ``step()`` raises for a wrapped optimizer keying its own dict by the params."""
    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(ScaledSGD(model.parameters()))
    loss_fn(model, *batch(dist.get_rank(), 0)).backward()
    with pytest.raises(RuntimeError) as error:
        opt.step()
    assert isinstance(error.value.__cause__, KeyError)
    return str(error.value)


def test_a_wrapped_optimizer_keying_a_dict_by_the_params_raises_naming_the_param(pools):
    # It raised a bare KeyError that printed a tensor: nothing said the key is a virtual param.
    for message in pools[2].run(keyed_by_param_worker):
        assert re.search(r"ScaledSGD.step\(\) looked up a param in a dict of its own and got a KeyError: zeroshard hands it a virtual "
                         r"param for param_groups\[0\]\['params'\]\[\d+\]", message), message


def compiled_step_worker() -> tuple[bool, list[int], str]:
    """Train TinyNet stepping through a ``torch.compile``d function, then the same eagerly: (equal params, how often a step
    post-hook ran in 3 steps each, what a fullgraph one raised)."""
    finals, hooked = [], []
    for compiled in (True, False):
        torch.manual_seed(0)
        model = TinyNet()
        opt = zeroshard.ShardedOptimizer(_adamw(model))
        calls = []
        opt.register_step_post_hook(lambda *args, calls=calls: calls.append(1))
        step = torch.compile(lambda opt=opt: opt.step(), backend="eager") if compiled else opt.step
        for i in range(3):
            loss_fn(model, *batch(dist.get_rank(), i)).backward()
            step()
            opt.zero_grad()
        finals.append([p.detach().clone() for p in model.parameters()])
        hooked.append(len(calls))
        if compiled:
            loss_fn(model, *batch(dist.get_rank(), 3)).backward()
            with pytest.raises(Exception) as raised:  # torch._dynamo.exc.Unsupported
                torch.compile(lambda opt=opt: opt.step(), backend="eager", fullgraph=True)()
        opt.close()
    torch._dynamo.reset()
    return all(torch.equal(a, b) for a, b in zip(*finals)), hooked, str(raised.value)


def test_a_compiled_function_calling_step_runs_it_eagerly(pools):
    # Dynamo traced step(): graph breaks and recompiles each step until it gave up, and once an internal Dynamo error on one
    # rank only (the other then waited in a collective).
    for equal, hooked, raised in pools[2].run(compiled_step_worker):
        assert equal
        assert hooked == [3, 3], hooked  # the step hooks' wrapper ran traced, the body eagerly: twice each step before
        assert "zeroshard: ShardedOptimizer.step() runs outside compiled frames" in raised, raised


def clip_on_one_rank_worker() -> str:
    """Rank 1 clips (``opt.clip_grad_norm_``), rank 0 does not: what the step (rank 0) or the clip (rank 1) raised."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(_adamw(model))
    loss_fn(model, *batch(dist.get_rank(), 0)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        if dist.get_rank() == 1:
            opt.clip_grad_norm_(0.05)
        opt.step()
    except RuntimeError as error:
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        return str(error)
    return "no error"


def huge_clip_worker() -> bool:
    """``max_grad_norm=1e20`` and ``clip_grad_norm_(inf)`` on every rank: whether both steps ran (the agreement check has no false alarm)."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(_adamw(model), max_grad_norm=1e20)
    for step, clip in enumerate((None, math.inf)):
        loss_fn(model, *batch(dist.get_rank(), step)).backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
    return True


def test_a_clip_on_some_ranks_only_raises_on_every_rank(pools):
    assert pools[2].run(huge_clip_worker) == [True, True]
    # Its all-reduce pairs with the others' step: each rank would update its shard with its own clip (no error before).
    step, clip = pools[2].run(clip_on_one_rank_worker)
    assert step.startswith("step(): the ranks clip this step differently (max_norm here 0, 0 for none; 0 on rank 0; 0.05 on rank 1)"), step
    assert clip.startswith("clip_grad_norm_(): the ranks clip this step differently (max_norm here 0.05, 0 for none; 0 on rank 0; 0.05 on rank 1)"), clip


def clip_slightly_off_worker() -> str:
    """Every rank clips, the last at a max_norm 0.1% above the others': what the clip raised."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(_adamw(model))
    loss_fn(model, *batch(dist.get_rank(), 0)).backward()
    try:
        opt.clip_grad_norm_(1.001 if dist.get_rank() == dist.get_world_size() - 1 else 1.0)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_clip_slightly_off_on_one_of_three_ranks_raises_on_every_rank(pools):
    # Each rank compared the sums of the ranks' codes with its own max_norm: near the tolerance the one rank off raised alone, and
    # the others stepped on into a gloo error at the next collective.
    for rank, message in enumerate(pools[3].run(clip_slightly_off_worker)):
        assert message.startswith(f"clip_grad_norm_(): the ranks clip this step differently (max_norm here {1.001 if rank == 2 else 1.0:g}, 0 for none; "
                                  "1 on ranks 0, 1; 1.001 on rank 2)"), (rank, message)


def lr_on_one_rank_worker(group: int, stage: int, factor: float, hybrid: bool) -> list[object]:
    """Every rank steps twice with the same lr (a scheduler's change alike on every rank passes), then the last rank multiplies
    param group ``group``'s lr by ``factor`` (as ReduceLROnPlateau fed its own loss would): [whether the params stayed as they
    were, what step() raised]. ``hybrid``: shard groups of 2."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(_adamw(model), stage=stage, process_group=zeroshard.hybrid_mesh(2) if hybrid else None)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _train(model, opt, range(2))
    scheduler.step()
    if dist.get_rank() == dist.get_world_size() - 1:
        opt.param_groups[group]["lr"] *= factor
    loss_fn(model, *batch(dist.get_rank(), 2)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        opt.step()
    except RuntimeError as error:
        return [all(torch.equal(a, b) for a, b in zip(before, model.parameters())), str(error)]
    return [True, "no error"]


@pytest.mark.parametrize("world_size, group, stage, factor, hybrid", [(2, 0, 1, 0.5, False), (2, 1, 2, 0.5, False), (3, 0, 2, 1.001, False),
                                                                  (4, 1, 2, 0.5, True)])
def test_a_learning_rate_set_on_some_ranks_only_raises_on_every_rank(pools, world_size, group, stage, factor, hybrid):
    # Each rank would step its own shard with its own lr, and the replicas stay identical: silent where DDP's drift apart.
    lrs = [5e-3] * (world_size - 1) + [5e-3 * factor]
    others = ", ".join(str(r) for r in range(world_size - 1))
    held = f"0.005 on rank{'s' if world_size > 2 else ''} {others}; {5e-3 * factor:.7g} on rank {world_size - 1})"
    for rank, (unchanged, message) in enumerate(pools[world_size].run(lr_on_one_rank_worker, group, stage, factor, hybrid)):
        assert unchanged, rank
        assert message.startswith(f"step(): the ranks step AdamW's param group {group} with different learning rates (lr here {lrs[rank]:g}; "
                                  + held), (rank, message)


class _LrAuto(torch.optim.Optimizer):
    """An optimizer whose groups' ``lr`` is not a number: its own business, not compared across ranks."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": "auto"})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-1e-3)


def lr_not_a_number_worker() -> bool:
    torch.manual_seed(0)
    model = TinyNet()
    _train(model, zeroshard.ShardedOptimizer(_LrAuto(model.parameters())), range(2))
    return True


def test_a_learning_rate_that_is_not_a_number_is_not_compared(pools):
    assert pools[2].run(lr_not_a_number_worker) == [True, True]


def scheduler_on_wrapped_worker() -> list[str]:
    """A scheduler built on the wrapped optimizer (as a framework holding ``opt.optimizer`` builds it), the fused update and
    the wrapped optimizer's own step: the warnings its ``step()`` gave."""
    import warnings

    messages = []
    for inner in (lambda ps: torch.optim.AdamW(ps, lr=1e-2), lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)):
        model = TinyNet()
        opt = zeroshard.ShardedOptimizer(inner(param_groups(model)))
        schedule = torch.optim.lr_scheduler.LambdaLR(opt.optimizer, lambda step: 1.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(2):
                loss_fn(model, *batch(dist.get_rank(), step)).backward()
                opt.step()
                opt.zero_grad()
                schedule.step()
        messages += [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
        opt.close()
    return messages


def test_a_scheduler_on_the_wrapped_optimizer_sees_its_steps(pools):
    # The fused update steps the wrapped optimizer's state without its step(): the scheduler warned it came first.
    assert pools[2].run(scheduler_on_wrapped_worker) == [[], []]


def backward_after_clip_worker(no_sync: bool) -> str:
    """``opt.clip_grad_norm_()``, then one more backward (under ``no_sync()`` or not), then ``step()``: what the step raised,
    the params untouched."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = zeroshard.ShardedOptimizer(_adamw(model))
    loss_fn(model, *batch(dist.get_rank(), 0)).backward()
    opt.clip_grad_norm_(0.05)
    with opt.no_sync() if no_sync else contextlib.nullcontext():
        loss_fn(model, *batch(dist.get_rank(), 1)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        opt.step()
        return "no error"
    except RuntimeError as error:
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        return str(error)
    finally:
        opt.close()


@pytest.mark.parametrize("no_sync", [False, True])
def test_a_backward_between_clip_and_step_raises(pools, no_sync):
    # The step reused the clip's statistics and never reduced that backward's gradients: params 2e-2 off DDP's, silently.
    for error in pools[2].run(backward_after_clip_worker, no_sync):
        assert "a backward ran after opt.clip_grad_norm_() and before step()" in error, error
