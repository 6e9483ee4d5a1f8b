"""Checkpoints of partition="param" optimizers (torch.optim.Muon + AdamW, Adafactor) at any world size.

The reference is the uninterrupted run: training saved at 2 ranks and resumed at 1, 3 or 4 ranks
(through ``torch.distributed.checkpoint`` or the consolidated full format) must continue as the
2-rank run does, within rtol 1e-6 (the gradient sum runs in another order); resumed at 2 ranks,
bitwise. Every run sees the same global batch of 12 micro-batches, split among its ranks. A
resume without the optimizer state is the negative control: it must miss by far. The full format
is plain ``torch.optim``: it loads into the unsharded torch optimizer, and the unsharded
optimizer's own state dict loads into ``ShardedOptimizer``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from models import TinyNet, batch, loss_fn, relative_error, tolerance_ratio

import zeroshard
from zeroshard.convert import convert

MICRO = 12  # micro-batches per step, over all ranks


class NoMetaAdamW(torch.optim.AdamW):
    """An Adam subclass (so partition="param") that, as torch's with ``capturable=True`` on a GPU, asserts on a meta param."""

    def step(self, closure=None):
        assert all(p.device.type != "meta" for group in self.param_groups for p in group["params"]), "no meta params"
        return super().step(closure)


def _inner(model: TinyNet, kind: str) -> list[torch.optim.Optimizer]:
    hidden = [model.fc1.weight, model.fc2.weight, model.branch.weight]
    rest = [p for p in model.parameters() if p.requires_grad and all(p is not h for h in hidden)]
    if kind == "muon":
        return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=1e-2, foreach=False)]
    if kind == "no_meta":  # was an AssertionError at construction and in checkpoints
        return [NoMetaAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=False)]
    return [torch.optim.Adafactor([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=False)]


def _model(dtype: torch.dtype) -> TinyNet:
    torch.manual_seed(0)
    return TinyNet().to(dtype)


def _build(kind: str, dtype: torch.dtype = torch.float32, shard_size: int | None = None) -> tuple[TinyNet, list[zeroshard.ShardedOptimizer]]:
    model = _model(dtype)
    mesh = zeroshard.hybrid_mesh(shard_size) if shard_size else None
    return model, [zeroshard.ShardedOptimizer(o, bucket_size_mb=200 * 4 / 2**20, process_group=mesh) for o in _inner(model, kind)]


def _train(model, opts, first: int, steps: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    per = MICRO // world
    for step in range(first, first + steps):
        for m in range(per):
            x, y = batch(rank * per + m, step)
            (loss_fn(model, x, y) / per).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()


def save_worker(kind: str, dtype: torch.dtype, directory: str, shard_size: int | None = None) -> None:
    """4 steps, save (DCP, full, this rank's own shard), 4 more steps, keep the final params."""
    model, opts = _build(kind, dtype, shard_size)
    _train(model, opts, 0, 4)
    dcp.save({"model": model.state_dict(), **{f"optim{i}": opt for i, opt in enumerate(opts)}}, checkpoint_id=f"{directory}/dcp")
    for i, opt in enumerate(opts):
        torch.save(opt.state_dict(), f"{directory}/rank{dist.get_rank()}.optim{i}.pt")
        opt.consolidate_state_dict(to=0)
        if dist.get_rank() == 0:
            torch.save(opt.state_dict(), f"{directory}/full.optim{i}.pt")
    _train(model, opts, 4, 4)
    if dist.get_rank() == 0:
        torch.save([p.detach().clone() for p in model.parameters()], f"{directory}/final.pt")


def resume_worker(kind: str, dtype: torch.dtype, directory: str, method: str) -> tuple[float, bool]:
    """Resume from the 4-step checkpoint with ``method``, train 4 steps: (tolerance ratio, or for bf16 the relative error; bitwise)
    against the uninterrupted run."""
    model, opts = _build(kind, dtype)
    state = {"model": model.state_dict(), **({f"optim{i}": opt for i, opt in enumerate(opts)} if method == "dcp" else {})}
    dcp.load(state, checkpoint_id=f"{directory}/dcp")
    model.load_state_dict(state["model"])
    for i, opt in enumerate(opts):
        if method in ("full", "full without master"):
            full = torch.load(f"{directory}/full.optim{i}.pt", weights_only=False)
            if method == "full without master":
                full["zeroshard"]["master"] = {}
            opt.load_state_dict(full)
        elif method == "own":
            opt.load_state_dict(torch.load(f"{directory}/rank{dist.get_rank()}.optim{i}.pt", weights_only=False))
    _train(model, opts, 4, 4)
    final = torch.load(f"{directory}/final.pt")
    expected = _model(dtype)
    with torch.no_grad():
        for p, value in zip(expected.parameters(), final):
            p.copy_(value)
    ratio = tolerance_ratio(model, expected) if dtype == torch.float32 else relative_error(model, expected)
    return ratio, all(torch.equal(a, b) for a, b in zip(model.parameters(), expected.parameters()))


@pytest.mark.parametrize("kind", ["muon", "adafactor", "no_meta"])
def test_resume_at_any_world_size(pools, tmp_path, kind):
    pools[2].run(save_worker, kind, torch.float32, str(tmp_path))
    resumes = [("own", 2), ("dcp", 1), ("dcp", 3), ("full", 4)] if kind == "muon" else [("dcp", 2), ("full", 3)]
    for method, world in resumes:
        for ratio, bitwise in pools[world].run(resume_worker, kind, torch.float32, str(tmp_path), method):
            assert ratio <= 1.0, (method, world, ratio)
            assert bitwise or world != 2, (method, world)
    # Negative control: the model alone, the optimizer state left out, misses by far.
    for ratio, _ in pools[2].run(resume_worker, kind, torch.float32, str(tmp_path), "none"):
        assert ratio > 100.0


def test_bf16_resume_carries_the_fp32_master(pools, tmp_path):
    pools[2].run(save_worker, "muon", torch.bfloat16, str(tmp_path))
    for method in ("own", "dcp", "full"):
        assert all(bitwise for _, bitwise in pools[2].run(resume_worker, "muon", torch.bfloat16, str(tmp_path), method)), method
    # Without the fp32 master the resume starts from the rounded params: no longer bitwise.
    assert not any(bitwise for _, bitwise in pools[2].run(resume_worker, "muon", torch.bfloat16, str(tmp_path), "full without master"))
    # At 3 ranks the bf16 gradients are summed in another order: close, not equal.
    assert all(error < 1e-2 for error, _ in pools[3].run(resume_worker, "muon", torch.bfloat16, str(tmp_path), "dcp"))


def test_hybrid_checkpoint_is_written_once_per_shard_group_and_loads_anywhere(pools, tmp_path):
    pools[2].run(save_worker, "muon", torch.float32, str(tmp_path / "flat"))
    pools[4].run(save_worker, "muon", torch.float32, str(tmp_path / "hybrid"), 2)  # 2 shard groups of 2
    size = {name: sum(f.stat().st_size for f in (tmp_path / name / "dcp").glob("*.distcp")) for name in ("hybrid", "flat")}
    assert size["hybrid"] < 1.2 * size["flat"], size  # the two replicas are not both written
    assert all(ratio <= 1.0 for ratio, _ in pools[3].run(resume_worker, "muon", torch.float32, str(tmp_path / "hybrid"), "dcp"))


def unsharded_worker(kind: str, directory: str) -> None:
    """World size 1, plain torch: the full dicts load into the unsharded optimizers and continue as zeroshard did."""
    model = _model(torch.float32)
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=f"{directory}/dcp")
    model.load_state_dict(sd["model"])
    inner = _inner(model, kind)
    for i, opt in enumerate(inner):
        opt.load_state_dict(torch.load(f"{directory}/full.optim{i}.pt", weights_only=False))
    for step in range(4, 8):
        for m in range(MICRO):
            x, y = batch(m, step)
            (loss_fn(model, x, y) / MICRO).backward()
        for opt in inner:
            opt.step()
            opt.zero_grad()
    final = torch.load(f"{directory}/final.pt")
    expected = _model(torch.float32)
    with torch.no_grad():
        for p, value in zip(expected.parameters(), final):
            p.copy_(value)
    assert tolerance_ratio(model, expected) <= 1.0
    # ... and the unsharded optimizers' own state dicts load back into zeroshard.
    for i, opt in enumerate(inner):
        torch.save(opt.state_dict(), f"{directory}/plain.optim{i}.pt")


def from_plain_worker(kind: str, directory: str) -> list[bool]:
    """The unsharded optimizers' state dicts (after 8 steps) load into ShardedOptimizer: its state equals theirs."""
    model, opts = _build(kind)
    same = []
    for i, opt in enumerate(opts):
        plain = torch.load(f"{directory}/plain.optim{i}.pt", weights_only=False)
        opt.load_state_dict(plain)
        opt.consolidate_state_dict(to=0)
        if dist.get_rank() == 0:
            full = opt.state_dict()
            for index, entry in plain["state"].items():
                same.append(sorted(entry) == sorted(full["state"][index]) and all(torch.equal(v, full["state"][index][k]) for k, v in entry.items()))
    return same


@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_full_format_is_plain_torch(pools, tmp_path, kind):
    pools[2].run(save_worker, kind, torch.float32, str(tmp_path))
    # python -m zeroshard.convert writes the same full format, with no process group, for each optimizer in the checkpoint
    # (before, only --optim-key's: the other stayed a raw rank shard).
    convert(tmp_path / "dcp", tmp_path / "converted.pt")
    for i in range(len(_inner(TinyNet(), kind))):
        converted = torch.load(tmp_path / "converted.pt", weights_only=False)[f"optim{i}"]
        full = torch.load(tmp_path / f"full.optim{i}.pt", weights_only=False)
        assert converted["state"].keys() == full["state"].keys() and len(full["state"]) > 0
        for index, entry in full["state"].items():
            assert sorted(entry) == sorted(converted["state"][index])
            assert all(torch.equal(value, converted["state"][index][key]) for key, value in entry.items())
    pools[1].run(unsharded_worker, kind, str(tmp_path))
    same = pools[2].run(from_plain_worker, kind, str(tmp_path))[0]
    assert same and all(same)


def mismatch_worker() -> None:
    model, opts = _build("adafactor")
    _train(model, opts, 0, 1)
    other_model, (other,) = _build("adafactor")
    _train(other_model, [other], 0, 2)
    adamw = zeroshard.ShardedOptimizer(torch.optim.AdamW(_model(torch.float32).parameters(), lr=1e-2))
    with pytest.raises(ValueError, match=r"sharded checkpoint of partition='flat', this optimizer has partition='param': call consolidate_state_dict"):
        opts[0].load_state_dict(adamw.state_dict())
    with pytest.raises(ValueError, match=r"sharded checkpoint of partition='param', this optimizer has partition='flat'"):
        adamw.load_state_dict(opts[0].state_dict())
    opts[0].consolidate_state_dict(to=0)
    full = opts[0].state_dict() if dist.get_rank() == 0 else None
    if full is not None:
        # A row_var of the wrong shape is named, with what Adafactor keeps; the optimizer loaded into is left as it was.
        index = next(i for i, entry in full["state"].items() if "row_var" in entry)
        full["state"][index]["row_var"] = full["state"][index]["row_var"][:-1]
        before = checkpoint_tensors(other.state_dict())
        with pytest.raises(ValueError, match=rf"state_dict state of param_groups\[0\]\['params'\]\[{index}\] has .*'row_var'.* Adafactor keeps"):
            other.load_state_dict(full)
        assert all(torch.equal(a, b) for a, b in zip(before, checkpoint_tensors(other.state_dict())))
        # Another class's hyperparameters (Muon's float eps, Adafactor's is a pair): said so, not only Adafactor's own TypeError.
        with pytest.raises(ValueError, match=r"the state_dict's param_groups\[0\] does not build Adafactor \(saved by another optimizer class\?\)"):
            other.load_state_dict({**full, "param_groups": [{**group, "eps": 1e-7} for group in full["param_groups"]]})
    for opt in (*opts, other, adamw):
        opt.close()


def checkpoint_tensors(state_dict: dict) -> list[torch.Tensor]:
    return [v for entry in state_dict["params"].values() for v in entry.values()]


def test_mismatches_raise_naming_the_way_out(pools):
    pools[2].run(mismatch_worker)


class ForwardingSGD(torch.optim.SGD):
    """A subclass that forwards its arguments (``**kwargs``), as wrapper libraries write them."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)


def forwarding_worker(directory: str) -> bool:
    """ForwardingSGD(momentum=0.9) runs partition="param" (not known to be element-wise); its consolidated state
    equals the unsharded optimizer's, trained on the same data; without momentum, nothing to convert is no error."""
    torch.manual_seed(0)
    model, ref = TinyNet(), TinyNet()
    ref.load_state_dict(model.state_dict())
    opt = zeroshard.ShardedOptimizer(ForwardingSGD(model.parameters(), lr=0.1, momentum=0.9))
    plain = ForwardingSGD([p for p in ref.parameters()], lr=0.1, momentum=0.9)
    world = dist.get_world_size()
    for step in range(2):
        for r in range(world):  # the unsharded reference sees every rank's batch, averaged
            x, y = batch(r, step)
            (loss_fn(ref, x, y) / world).backward()
        x, y = batch(dist.get_rank(), step)
        loss_fn(model, x, y).backward()
        opt.step()
        plain.step()
        opt.zero_grad()
        plain.zero_grad()
    assert opt.partition == "param"
    opt.consolidate_state_dict(to=0)
    full = opt.state_dict() if dist.get_rank() == 0 else None
    no_state = zeroshard.ShardedOptimizer(ForwardingSGD(TinyNet().parameters(), lr=0.1))
    dcp.save({"optim": no_state}, checkpoint_id=f"{directory}/no_state")
    if full is None:
        return True
    expected = plain.state_dict()["state"]
    return sorted(full["state"]) == sorted(expected) and all(
        sorted(full["state"][i]) == sorted(entry) and torch.allclose(full["state"][i]["momentum_buffer"], entry["momentum_buffer"], rtol=1e-6, atol=1e-7)
        for i, entry in expected.items())


def test_subclass_forwarding_kwargs_keeps_its_state(pools, tmp_path):
    assert all(pools[2].run(forwarding_worker, str(tmp_path)))
    convert(tmp_path / "no_state", tmp_path / "no_state.pt")  # every entry empty: converts to no state, no KeyError
    assert torch.load(tmp_path / "no_state.pt", weights_only=False)["optim"]["state"] == {}
