"""User post-accumulate-grad hooks that change gradients, against DDP + AdamW with the same hooks.

DDP's reducer hooks each param's grad accumulator, so it reduces what every post-accumulate-grad
hook left in ``.grad`` (scaled, replaced, set to ``None``). zeroshard takes each gradient once the
hooks after its own have run, so it reduces the same. In a backward after one that already reduced
the step's gradients (accumulation without ``no_sync()``), DDP shows a hook the all-reduced sum,
which no rank holds here: a hook that changes a gradient there (or one registered before the
optimizer, whose effect zeroshard cannot see) is refused, naming the param.

The reduce-scatter is made to read its whole input at launch, as a GPU collective on its own
stream may: a bucket launched before a hook ran would then miss what the hook wrote.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from models import VOCAB, TinyNet, average_grads, batch, loss_fn, param_groups, tolerance_ratio
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard

STEPS = 4


# The hooks change the tied embedding's gradient only: it is used on every rank in every step.
def halve_in_place(p: nn.Parameter) -> None:
    if p.shape[0] == VOCAB:
        p.grad.mul_(0.5)


def halve_by_replacing(p: nn.Parameter) -> None:
    if p.shape[0] == VOCAB:
        p.grad = p.grad * 0.5


def drop(p: nn.Parameter) -> None:
    if p.shape[0] == VOCAB:
        p.grad = None  # DDP: unused on every rank, so not stepped


def drop_on_rank_0(p: nn.Parameter) -> None:
    if p.shape[0] == VOCAB and dist.get_rank() == 0:
        p.grad = None  # DDP: unused on rank 0 only, so stepped with rank 1's gradient averaged over both


def _reference_pair() -> tuple[nn.Module, nn.Module, DDP, torch.optim.Optimizer]:
    """(TinyNet for zeroshard, its twin, the twin under DDP(find_unused_parameters=True), AdamW(foreach=False) on the twin), seeded alike."""
    torch.manual_seed(0)
    ref_model = TinyNet()
    model = copy.deepcopy(ref_model)
    return model, ref_model, DDP(ref_model, find_unused_parameters=True), torch.optim.AdamW(param_groups(ref_model), lr=1e-2, foreach=False)


def _hooked_training(stage: int, hook, accumulation: str = "none", overlap_comm: bool = True, zero: str = "set_to_none",
                hook_first: bool = False) -> float:
    """The worst tolerance ratio against DDP + AdamW over STEPS steps of 2 micro-steps (1 with ``accumulation="none"``).

    ``zero``: what runs between steps: ``"set_to_none"`` (``opt.zero_grad()`` / ``model.zero_grad()``
    in turns), ``"keep"`` (``zero_grad(set_to_none=False)`` on both), ``"nothing"`` (zeroshard's
    step consumes the gradients; the reference zeroes them). ``hook_first``: the hook is
    registered on zeroshard's model before the optimizer is built.
    """
    from zeroshard.comm import collectives

    rank = dist.get_rank()
    model, ref_model, ref, ref_opt = _reference_pair()
    hooked = [p for p in ref_model.parameters() if p.requires_grad]
    if hook_first:
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(hook)
    else:
        hooked += [p for p in model.parameters() if p.requires_grad]
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2, foreach=False), stage=stage,
                                     bucket_size_mb=200 * 4 / 2**20, overlap_comm=overlap_comm)
    for p in hooked:
        p.register_post_accumulate_grad_hook(hook)
    original = collectives.reduce_scatter
    collectives.reduce_scatter = lambda output, input, group, **kwargs: original(output, input.clone(), group, **kwargs)
    worst = 0.0
    try:
        for step in range(STEPS):
            micro = 1 if accumulation == "none" else 2
            for m in range(micro):
                local = accumulation == "no_sync" and m < micro - 1
                x, y = batch(rank, step, m)
                with ref.no_sync() if local else contextlib.nullcontext():
                    (loss_fn(ref, x, y) / micro).backward()
                with opt.no_sync() if local else contextlib.nullcontext():
                    (loss_fn(model, x, y) / micro).backward()
            ref_opt.step()
            opt.step()
            ref_model.zero_grad(set_to_none=zero != "keep")
            if zero == "keep":
                model.zero_grad(set_to_none=False)
            elif zero == "set_to_none":
                (model.zero_grad if step % 2 else opt.zero_grad)()
            worst = max(worst, tolerance_ratio(model, ref_model))
    finally:
        collectives.reduce_scatter = original
        opt.close()
    return worst


def hook_worker(stage: int, hook, options: dict) -> float:
    return _hooked_training(stage, hook, **options)


MATCH = [
    (halve_in_place, {}),
    (halve_in_place, {"accumulation": "no_sync"}),
    (halve_in_place, {"overlap_comm": False}),
    (halve_in_place, {"zero": "keep"}),
    (halve_in_place, {"zero": "nothing"}),
    (halve_in_place, {"hook_first": True}),
    (halve_by_replacing, {}),
    (drop, {}),
    (drop_on_rank_0, {}),
]
REFUSED = [(halve_by_replacing, {"accumulation": "backward"}), (halve_in_place, {"accumulation": "backward", "hook_first": True})]


@pytest.mark.parametrize("stage", [1, 2])
def test_hooks_after_the_optimizer_change_the_gradients_as_under_ddp(pools, stage):
    for hook, options in MATCH:
        worst = max(pools[2].run(hook_worker, stage, hook, options))
        assert worst <= 1.0, f"{hook.__name__} {options}: params off DDP + AdamW by {worst:.3g}x the tolerance (rtol 1e-6)"


@pytest.mark.parametrize("stage", [1, 2])
def test_hook_changing_a_gradient_reduced_earlier_in_the_step_is_refused(pools, stage):
    for hook, options in REFUSED:
        with pytest.raises(RuntimeError, match=r"params'\]\[\d+\]: a post-accumulate-grad hook changed its gradient .* opt.no_sync\(\)"):
            pools[2].run(hook_worker, stage, hook, options)


def accumulate_in_place_worker() -> list[bool]:
    """Stage 1, three steps (``opt.zero_grad()``, then ``model.zero_grad()``, then a ``no_sync`` micro-step first): per
    backward, whether every param's gradient reached its hooks (one registered before the optimizer) already inside the
    flat grad buffer, as the same ``.grad`` object every step, and whether the step equals DDP + AdamW's."""
    rank = dist.get_rank()
    model, ref_model, ref, ref_opt = _reference_pair()
    seen: dict[nn.Parameter, list[torch.Tensor]] = {p: [] for p in model.parameters() if p.requires_grad}
    for p in seen:
        p.register_post_accumulate_grad_hook(lambda q: seen[q].append(q.grad))
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2, foreach=False), stage=1)
    flat = [g.flat for g in opt._reducer._grads]
    inside = lambda t: any(t.untyped_storage().data_ptr() == f.untyped_storage().data_ptr() for f in flat)  # noqa: E731
    results = []
    try:
        for step in range(3):
            micro = 2 if step == 2 else 1
            for m in range(micro):
                x, y = batch(rank, step, m)
                with ref.no_sync() if m < micro - 1 else contextlib.nullcontext():
                    (loss_fn(ref, x, y) / micro).backward()
                with opt.no_sync() if m < micro - 1 else contextlib.nullcontext():
                    (loss_fn(model, x, y) / micro).backward()
            results.append(all(grads and all(inside(g) and g is grads[0] for g in grads) for grads in seen.values()))
            ref_opt.step()
            opt.step()
            ref_model.zero_grad()
            (model.zero_grad if step % 2 else opt.zero_grad)()
            results.append(tolerance_ratio(model, ref_model) <= 1.0)
    finally:
        opt.close()
    return results


def test_stage1_gradients_accumulate_straight_into_the_flat_grad_buffer(pools):
    # A hook registered before the optimizer sees the same .grad, a view of the flat buffer, at every
    # backward: autograd added the gradient there (no copy), and the steps still equal DDP's.
    for results in pools[2].run(accumulate_in_place_worker):
        assert results == [True] * 6, results


def dropped_micro_step_worker(between: str) -> float:
    """Stage 1, SGD against DDP + SGD: a step, then ``between`` (``"keep"``: ``zero_grad(set_to_none=False)``, which
    leaves the reduced gradients in ``.grad``; ``"nothing"``: the step consumed them), then a ``no_sync`` micro-step whose
    gradient user code drops (``model.zero_grad()``) before the last micro-step; the largest param difference."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref_model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model = copy.deepcopy(ref_model)
    ref = DDP(ref_model)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    opt = zeroshard.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stage=1)
    generator = torch.Generator().manual_seed(rank + 1)
    xs = [torch.randn(3, 4, generator=generator) for _ in range(3)]
    try:
        for net, optimizer, local in ((ref, ref_opt, ref.no_sync), (model, opt, opt.no_sync)):
            net(xs[0]).pow(2).sum().backward()
            optimizer.step()
            if between == "keep" or net is ref:
                optimizer.zero_grad(set_to_none=between != "keep")
            with local():
                net(xs[1]).pow(2).sum().backward()
            net.zero_grad(set_to_none=True)  # the first micro-step's gradient is dropped
            net(xs[2]).pow(2).sum().backward()
            optimizer.step()
        return max(float((a - b).abs().max()) for a, b in zip(model.parameters(), ref_model.parameters()))
    finally:
        opt.close()


@pytest.mark.parametrize("between", ["keep", "nothing"])
def test_a_dropped_micro_step_gradient_stays_dropped(pools, between):
    # the flat grad buffer held the swapped-back gradient: it must not be handed out as zeros again (a review found it was)
    assert pools[2].run(dropped_micro_step_worker, between) == [0.0, 0.0]


def rebound_grad_worker(stage: int, how: str) -> float:
    """SGD against torch's SGD on the all-reduced mean gradient (DDP's; DDP itself does not follow a cast of its module) over
    two micro-steps, zeroshard's first under ``no_sync``, where the gradient's storage is replaced in place: ``"to"``:
    ``model.to("cpu:0")`` between them (``Module._apply`` sets ``p.grad.data``); ``"double_float"``: ``model.double().float()``
    likewise; ``"hook"``: a post-accumulate-grad hook doing ``p.grad.data = 2 * p.grad.data``. The largest param difference."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref_model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model = copy.deepcopy(ref_model)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.5)
    opt = zeroshard.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), stage=stage)
    if how == "hook":
        for net in (ref_model, model):
            net[0].weight.register_post_accumulate_grad_hook(lambda p: setattr(p.grad, "data", 2 * p.grad.data))
    generator = torch.Generator().manual_seed(rank + 1)
    xs = [torch.randn(3, 4, generator=generator) for _ in range(2)]
    try:
        for net, optimizer, local in ((ref_model, ref_opt, contextlib.nullcontext), (model, opt, opt.no_sync)):
            with local():
                net(xs[0]).pow(2).sum().backward()
            if how == "to":
                net.to("cpu:0")
            elif how == "double_float":
                net.double().float()
            net(xs[1]).pow(2).sum().backward()
            if net is ref_model:
                average_grads(net)
            optimizer.step()
        return max(float((a - b).abs().max()) for a, b in zip(model.parameters(), ref_model.parameters()))
    finally:
        opt.close()


@pytest.mark.parametrize(("stage", "how"), [(1, "to"), (1, "double_float"), (1, "hook"), (2, "hook")])  # stage 2 keeps no view
def test_a_gradient_whose_storage_was_replaced_is_followed(pools, stage, how):
    # stage 1 kept accumulating into the moved storage and reduced the flat grad buffer without it (a review found it)
    assert pools[2].run(rebound_grad_worker, stage, how) == [0.0, 0.0]


def autograd_grad_worker(stage: int) -> list[bool]:
    """``torch.autograd.grad(loss, params)`` runs the params' tensor pre-hooks but accumulates nothing: before any
    backward ``.grad`` stays ``None``; after a reduced backward it stays the ShardedGrad left there; the step after
    equals DDP + AdamW's."""
    rank = dist.get_rank()
    model, ref_model, ref, ref_opt = _reference_pair()
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2, foreach=False), stage=stage)
    params = [p for p in model.parameters() if p.requires_grad]
    x, y = batch(rank, 0)
    try:
        torch.autograd.grad(loss_fn(model, x, y), params, allow_unused=True)
        none_before = all(p.grad is None for p in params)
        loss_fn(model, x, y).backward()
        left = [p.grad for p in params]
        torch.autograd.grad(loss_fn(model, x, y), params, allow_unused=True)
        kept = all(p.grad is g for p, g in zip(params, left))
        opt.step()
        loss_fn(ref, x, y).backward()
        ref_opt.step()
        return [none_before, kept, tolerance_ratio(model, ref_model) <= 1.0]
    finally:
        opt.close()


@pytest.mark.parametrize("stage", [1, 2])
def test_torch_autograd_grad_leaves_dot_grad_alone(pools, stage):
    for results in pools[2].run(autograd_grad_worker, stage):
        assert results == [True, True, True], results



def create_graph_worker(stage: int) -> float:
    """``backward(create_graph=True)`` (as a gradient-penalty loss runs it) against SGD with momentum on gradients averaged
    by hand: DDP itself refuses this backward (an in-place op on a leaf). The largest param difference over 4 steps."""
    torch.manual_seed(0)
    ref_model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    model = copy.deepcopy(ref_model)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    opt = zeroshard.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), stage=stage, bucket_size_mb=40 * 4 / 2**20)
    generator = torch.Generator().manual_seed(dist.get_rank() + 1)
    worst = 0.0
    try:
        for _ in range(4):
            x = torch.randn(3, 4, generator=generator)
            for net in (ref_model, model):
                net(x).pow(2).sum().backward(create_graph=True)
            for p in ref_model.parameters():
                p.grad = p.grad.detach()
            average_grads(ref_model)
            for net, optimizer in ((ref_model, ref_opt), (model, opt)):
                optimizer.step()
                net.zero_grad()
            worst = max(worst, max(float((a - b).abs().max()) for a, b in zip(model.parameters(), ref_model.parameters())))
        return worst
    finally:
        opt.close()


@pytest.mark.parametrize("stage", [1, 2])
def test_backward_with_create_graph_trains_like_averaged_gradients(pools, stage):
    """Stage 2 reduces the gradients' values (it raised before: a ``cat``/``add`` with ``out=`` on a gradient requiring grad)."""
    assert pools[2].run(create_graph_worker, stage) == [0.0, 0.0]
