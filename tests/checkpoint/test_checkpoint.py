"""Checkpoints: sharded (torch.save per rank, DCP at any world size) and full torch.optim format."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from models import TinyNet, batch, loss_fn, param_groups, tolerance_ratio
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard

BUCKET_MB = 100 * 4 / 2**20  # several buckets in TinyNet


def _build(seed: int = 0, stage: int = 2, dtype: torch.dtype = torch.float32, process_group=None, offload=None):
    torch.manual_seed(seed)
    model = TinyNet().to(dtype)
    opt = zeroshard.ShardedOptimizer(
        torch.optim.AdamW(param_groups(model), lr=1e-2, foreach=False), stage=stage, bucket_size_mb=BUCKET_MB, process_group=process_group,
        offload=offload,
    )
    return model, opt


def _train(model, opt, steps: range, ddp=None, use_branch: bool = True) -> None:
    for step in steps:
        x, y = batch(dist.get_rank(), step)
        loss_fn(ddp or model, x, y, use_branch=use_branch).backward()
        opt.step()
        model.zero_grad()


def reset_moments_worker(how: str) -> list[torch.Tensor]:
    """2 steps; every piece's Adam moments set to zero (``how``: new tensors assigned, or the same tensor objects given new
    storage by ``.data =`` or ``set_``); 2 steps more. The params, then each piece's moments as the state shows them."""
    model, opt = _build()
    _train(model, opt, range(2))
    for state in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if how == "assign":
                state[key] = torch.zeros_like(state[key])
            elif how == "data":
                state[key].data = torch.zeros_like(state[key])
            else:
                state[key].set_(torch.zeros_like(state[key]))
    _train(model, opt, range(2, 4))
    return [p.detach().clone() for p in model.parameters()] + [s[key].clone() for s in opt.state.values() for key in ("exp_avg", "exp_avg_sq")]


def test_moments_given_new_storage_in_place_are_followed_as_assigned_ones(pools):
    # The fused step binds each piece's state to its chunk's moments; a state tensor that keeps its identity but not its
    # storage (.data =, set_: what "move the optimizer state" helpers do) must be bound again, as an assigned one is.
    assigned = pools[2].run(reset_moments_worker, "assign")
    for how in ("data", "set_"):
        for ours, expected in zip(pools[2].run(reset_moments_worker, how), assigned):
            assert all(torch.equal(a, b) for a, b in zip(ours, expected)), how


# -- same world size ---------------------------------------------------------------------------


def same_world_worker(stage: int) -> None:
    """torch.save of each rank's sharded state dict at step 4; a fresh copy resumes bitwise."""
    model, opt = _build(stage=stage, dtype=torch.bfloat16)
    _train(model, opt, range(4))
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, saved)
    _train(model, opt, range(4, 8))
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=False)
    resumed, ropt = _build(seed=1, stage=stage, dtype=torch.bfloat16)
    resumed.load_state_dict(checkpoint["model"])
    ropt.load_state_dict(checkpoint["optim"])
    _train(resumed, ropt, range(4, 8))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))


@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_state_dict_resumes_bitwise_at_same_world_size(pools, stage):
    pools[2].run(same_world_worker, stage)


def full_matches_unsharded_worker() -> None:
    """The consolidated full dict equals DDP + AdamW's state, and loads into a plain AdamW."""
    model, opt = _build()
    torch.manual_seed(0)
    ref_model = TinyNet()
    ref_opt = torch.optim.AdamW(param_groups(ref_model), lr=1e-2, foreach=False)
    _train(model, opt, range(5))
    _train(ref_model, ref_opt, range(5), ddp=DDP(ref_model, find_unused_parameters=True))
    opt.consolidate_state_dict(to=1)
    full, ref = opt.state_dict(), ref_opt.state_dict()
    if dist.get_rank() != 1:
        assert "buckets" in full  # other ranks keep returning their shard
        return
    assert full["param_groups"] == ref["param_groups"]
    assert full["state"].keys() == ref["state"].keys()
    for index, expected in ref["state"].items():
        assert full["state"][index].keys() == expected.keys()
        assert torch.equal(full["state"][index]["step"], expected["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(full["state"][index][key], expected[key], rtol=1e-6, atol=1e-9)
    plain = torch.optim.AdamW(param_groups(TinyNet()), lr=0.5, foreach=False)
    plain.load_state_dict(full)
    assert plain.param_groups[0]["lr"] == pytest.approx(1e-2)


def test_full_state_dict_equals_unsharded_adamw_state(pools):
    pools[2].run(full_matches_unsharded_worker)


def plain_torch_into_sharded_worker() -> float:
    """A plain AdamW state dict loads into ShardedOptimizer; both then train alike."""
    torch.manual_seed(0)
    plain_model = TinyNet()
    plain = torch.optim.AdamW(param_groups(plain_model), lr=1e-2, foreach=False)
    for step in range(3):  # every rank trains the same unsharded copy on the same data
        loss_fn(plain_model, *batch(0, step)).backward()
        plain.step()
        plain.zero_grad()
    model, opt = _build(seed=5)
    model.load_state_dict(plain_model.state_dict())
    opt.load_state_dict(copy.deepcopy(plain.state_dict()))
    for step in range(3, 6):
        for m, o in ((plain_model, plain), (model, opt)):
            loss_fn(m, *batch(0, step)).backward()
            o.step()
            m.zero_grad()
    return tolerance_ratio(model, plain_model)


def test_plain_torch_state_dict_loads_into_sharded(pools):
    assert all(r <= 1.0 for r in pools[3].run(plain_torch_into_sharded_worker))


# -- across world sizes ------------------------------------------------------------------------

K, M_STEPS = 4, 4


def save_worker(stage: int, directory: str) -> None:
    """Train K steps, then save the model, a consolidated full dict, and a DCP checkpoint."""
    model, opt = _build(stage=stage)
    _train(model, opt, range(K))
    dcp.save({"model": model.state_dict(), "optim": opt}, checkpoint_id=f"{directory}/dcp")
    opt.consolidate_state_dict(to=0)
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), f"{directory}/model.pt")
        torch.save(opt.state_dict(), f"{directory}/optim_full.pt")
    dist.barrier()


def resume_worker(stage: int, directory: str, method: str, same_world: bool) -> tuple[float, bool]:
    """Resume at this world size and train M_STEPS more; compare with a reference run.

    Reference: at the same world size, an uninterrupted ShardedOptimizer run of K + M_STEPS steps
    (bitwise); else DDP + AdamW loaded with plain torch from the saved model and full dict.
    """
    model, opt = _build(seed=1, stage=stage)
    if method == "dcp":
        state = {"model": model.state_dict(), "optim": opt}
        dcp.load(state, checkpoint_id=f"{directory}/dcp")
        model.load_state_dict(state["model"])
    else:
        model.load_state_dict(torch.load(f"{directory}/model.pt"))
        opt.load_state_dict(torch.load(f"{directory}/optim_full.pt", weights_only=False))
    _train(model, opt, range(K, K + M_STEPS))
    if same_world:
        ref_model, ref_opt = _build(stage=stage)
        _train(ref_model, ref_opt, range(K + M_STEPS))
        return 0.0, all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
    ref_model = TinyNet()
    ref_model.load_state_dict(torch.load(f"{directory}/model.pt"))
    ref_opt = torch.optim.AdamW(param_groups(ref_model), lr=0.5, foreach=False)
    ref_opt.load_state_dict(torch.load(f"{directory}/optim_full.pt", weights_only=False))
    ddp = DDP(ref_model, find_unused_parameters=True) if dist.get_world_size() > 1 else None
    _train(ref_model, ref_opt, range(K, K + M_STEPS), ddp=ddp)
    return tolerance_ratio(model, ref_model), False


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("saved_at, loaded_at", [(4, 2), (2, 3), (3, 1), (1, 2), (2, 2)])
def test_resume_at_another_world_size(pools, tmp_path, stage, saved_at, loaded_at):
    pools[saved_at].run(save_worker, stage, str(tmp_path))
    for method in ("full", "dcp"):
        results = pools[loaded_at].run(resume_worker, stage, str(tmp_path), method, saved_at == loaded_at)
        for worst, bitwise in results:
            if saved_at == loaded_at:
                assert bitwise, f"{method}: resumed run differs from the uninterrupted one"
            else:
                assert worst <= 1.0, f"{method}: {worst:.3g}x the tolerance (rtol 1e-6, atol 1e-7)"


# -- what must be refused, and what must not change -------------------------------------------


def _snapshot(opt) -> list[torch.Tensor]:
    state = [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return state + [p.detach().clone() for g in opt.param_groups for p in g["params"]]


def mismatch_worker() -> None:
    model, opt = _build()
    _train(model, opt, range(2))
    sharded = opt.state_dict()
    opt.consolidate_state_dict(to=0)
    full = [opt.state_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(full, src=0)
    full = full[0]
    _train(model, opt, range(2, 3))  # a step ends the consolidated view
    before = _snapshot(opt)
    hyper_before = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]

    # Another rank's sharded dict, as torch.load brings it back.
    mine = io.BytesIO()
    torch.save(sharded, mine)
    files: list = [None, None]
    dist.all_gather_object(files, mine.getvalue())
    other = torch.load(io.BytesIO(files[1 - dist.get_rank()]), weights_only=False)
    with pytest.raises(ValueError, match=rf"shard of rank {1 - dist.get_rank()} of 2, this is rank {dist.get_rank()} of 2"):
        opt.load_state_dict(other)

    # Full dicts for another model: the param is named.
    wrong_shape = copy.deepcopy(full)
    wrong_shape["zeroshard"]["params"][2] = ((29, 7), "torch.float32")
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[2\] was saved with shape \(29, 7\)"):
        opt.load_state_dict(wrong_shape)
    wrong_dtype = copy.deepcopy(full)
    shape, _ = wrong_dtype["zeroshard"]["params"][0]
    wrong_dtype["zeroshard"]["params"][0] = (shape, "torch.bfloat16")
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] was saved with .* torch.bfloat16"):
        opt.load_state_dict(wrong_dtype)
    for corrupt in (lambda d: d["zeroshard"]["params"].pop(), lambda d: d["param_groups"][0]["params"].__setitem__(0, 99)):
        corrupted = copy.deepcopy(full)  # a corrupted file: an IndexError before
        corrupt(corrupted)
        with pytest.raises(ValueError, match=r"each index below that count once, and one pair per param \(a corrupted"):
            opt.load_state_dict(corrupted)
    plain = copy.deepcopy(full)
    del plain["zeroshard"]
    plain["state"][1]["exp_avg"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"'exp_avg' of param_groups\[0\]\['params'\]\[1\] has shape \(3, 3\)"):
        opt.load_state_dict(plain)
    with pytest.raises(ValueError, match="has 1 param groups, this optimizer 2"):
        opt.load_state_dict({**full, "param_groups": full["param_groups"][:1]})
    no_step = copy.deepcopy(full)
    del no_step["state"][1]["step"]  # torch's AdamW raises KeyError: it loaded as step 1 (the bias correction of its first)
    with pytest.raises(ValueError, match=r"\['params'\]\[1\] has \['exp_avg', 'exp_avg_sq'\], AdamW keeps \['exp_avg', 'exp_avg_sq', 'step'\]"):
        opt.load_state_dict(no_step)

    # Another optimizer's state.
    sgd = torch.optim.SGD(param_groups(TinyNet()), lr=0.1, momentum=0.9)
    for group in sgd.param_groups:
        for p in group["params"]:
            if p.requires_grad:  # as a training run steps them (a frozen param's state is refused first)
                p.grad = torch.ones_like(p)
    sgd.step()
    first = r"state of param_groups\[0\]\['params'\]\[0\] has "  # the first in torch.optim's order
    with pytest.raises(ValueError, match=first + r"\['momentum_buffer'\], AdamW keeps \['exp_avg', 'exp_avg_sq', 'step'\]"):
        opt.load_state_dict(sgd.state_dict())
    # Settings the fused AdamW update chosen at construction does not take (torch's AdamW would switch to its own update).
    amsgrad = copy.deepcopy(full)
    for group in amsgrad["param_groups"]:
        group["amsgrad"] = True
    for entry in amsgrad["state"].values():
        entry["max_exp_avg_sq"] = entry["exp_avg_sq"].clone()
    with pytest.raises(ValueError, match=r"state_dict: param_groups\[0\]\['amsgrad'\]=True, which the fused Adam/AdamW update"):
        opt.load_state_dict(amsgrad)
    with pytest.raises(ValueError, match="neither a zeroshard state dict nor a torch.optim one"):
        opt.load_state_dict({"zeroshard": {"format": "something else"}})

    # Sharded dicts are tied to bucket_size_mb (full ones load anywhere).
    torch.manual_seed(0)
    coarse = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(TinyNet()), lr=1e-2), bucket_size_mb=1.0)
    with pytest.raises(ValueError, match=r"params per bucket, this optimizer \(4,\): saved with another bucket_size_mb"):
        coarse.load_state_dict(sharded)

    after = _snapshot(opt)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(before, after))
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == hyper_before


def test_mismatches_raise_and_change_nothing(pools):
    pools[2].run(mismatch_worker)


def loaded_settings_worker() -> bool:
    """Adam(decoupled_weight_decay=True)'s full dict loaded into a ShardedOptimizer built on Adam(): the loaded setting
    (AdamW's decay) wins, as in torch.optim; whether both then train alike, bitwise."""
    def build(decoupled: bool):
        torch.manual_seed(0)
        model = TinyNet()
        return model, zeroshard.ShardedOptimizer(torch.optim.Adam(param_groups(model), lr=1e-2, weight_decay=0.1, decoupled_weight_decay=decoupled,
                                                                  foreach=False), bucket_size_mb=BUCKET_MB)
    model, opt = build(True)
    _train(model, opt, range(2))
    opt.consolidate_state_dict(to=0)
    full = [opt.state_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(full, src=0)
    resumed, ropt = build(False)
    resumed.load_state_dict(model.state_dict())
    ropt.load_state_dict(full[0])
    _train(model, opt, range(2, 5))
    _train(resumed, ropt, range(2, 5))
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))


def test_a_loaded_decoupled_weight_decay_is_the_one_stepped(pools):
    # The fused update read the weight decay style chosen at construction: L2 decay after this load, no error.
    assert pools[2].run(loaded_settings_worker) == [True, True]


def empty_and_mid_accumulation_worker(stage: int, directory: str) -> bool:
    """Save right after construction (DCP and full), and in the middle of gradient accumulation."""
    model, opt = _build(stage=stage)
    dcp.save({"optim": opt}, checkpoint_id=f"{directory}/empty")
    opt.consolidate_state_dict(to=0)
    empty_full = opt.state_dict() if dist.get_rank() == 0 else None
    assert not opt.state  # saving never steps
    fresh_model, fresh = _build(stage=stage)
    dcp.load({"optim": fresh}, checkpoint_id=f"{directory}/empty")
    if empty_full is not None:
        assert empty_full["state"] == {}
        fresh.load_state_dict(empty_full)
    assert not fresh.state

    # Mid-accumulation: a state_dict() between micro-batches must not disturb the step.
    for m, o, save in ((model, opt, True), (fresh_model, fresh, False)):
        for micro in range(2):
            loss_fn(m, *batch(dist.get_rank(), 0, micro)).backward()
            if save and micro == 0:
                o.state_dict()
        o.step()
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters()))


@pytest.mark.parametrize("stage", [1, 2])
def test_save_empty_and_mid_accumulation(pools, tmp_path, stage):
    assert all(pools[2].run(empty_and_mid_accumulation_worker, stage, str(tmp_path)))


def one_rank_state_dict_worker() -> None:
    model, opt = _build()
    _train(model, opt, range(1))
    if dist.get_rank() == 0:  # as HF Trainer and accelerate do
        opt.state_dict()
    _train(model, opt, range(1, 2))  # would hang if state_dict() had run a collective


def test_state_dict_runs_no_collective(pools):
    pools[2].run(one_rank_state_dict_worker, timeout=90)


def hybrid_save_worker(directory: str, shard_size: int) -> None:
    mesh = zeroshard.hybrid_mesh(shard_size) if shard_size < dist.get_world_size() else None
    model, opt = _build(process_group=mesh)
    _train(model, opt, range(K))
    dcp.save({"model": model.state_dict(), "optim": opt}, checkpoint_id=directory)


def hybrid_resume_worker(directory: str, shard_size: int, reference: str) -> float:
    mesh = zeroshard.hybrid_mesh(shard_size) if shard_size < dist.get_world_size() else None
    model, opt = _build(seed=1, process_group=mesh)
    state = {"model": model.state_dict(), "optim": opt}
    dcp.load(state, checkpoint_id=directory)
    model.load_state_dict(state["model"])
    _train(model, opt, range(K, K + M_STEPS))
    ref_model, ref_opt = _build(seed=1)
    ref_state = {"model": ref_model.state_dict(), "optim": ref_opt}
    dcp.load(ref_state, checkpoint_id=reference)  # the same state, saved by flat sharding
    ref_model.load_state_dict(ref_state["model"])
    _train(ref_model, ref_opt, range(K, K + M_STEPS))
    return tolerance_ratio(model, ref_model)


def test_hybrid_checkpoint_saved_once_per_shard_group_loads_anywhere(pools, tmp_path):
    pools[4].run(hybrid_save_worker, str(tmp_path / "hybrid"), 2)
    pools[4].run(hybrid_save_worker, str(tmp_path / "flat"), 4)
    size = {name: sum(f.stat().st_size for f in (tmp_path / name).glob("*.distcp")) for name in ("hybrid", "flat")}
    assert size["hybrid"] < 1.2 * size["flat"], size  # the two replicas are not both written
    # Hybrid (4 ranks, shard 2) -> flat at 2 ranks and hybrid at 4 ranks (shard 2 -> 4, 1); both
    # against the flat checkpoint of the same training run resumed the same way.
    assert all(r <= 1.0 for r in pools[2].run(hybrid_resume_worker, str(tmp_path / "hybrid"), 2, str(tmp_path / "flat")))
    assert all(r <= 1.0 for r in pools[4].run(hybrid_resume_worker, str(tmp_path / "hybrid"), 1, str(tmp_path / "flat")))
    assert all(r <= 1.0 for r in pools[4].run(hybrid_resume_worker, str(tmp_path / "flat"), 2, str(tmp_path / "hybrid")))


# -- property tests: full <-> sharded round trips ----------------------------------------------


def round_trip_worker(examples: int) -> int:
    """Random shapes, dtypes and bucket sizes: a full dict and a sharded dict of the same state
    load into a fresh optimizer (another bucket size for the full one) and give back the same
    full state. Derandomized, so every rank draws the same examples."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    shapes = st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=3), min_size=1, max_size=6)

    def build(shape_list, dtype, bucket_numel, seed):
        torch.manual_seed(seed)
        params = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in shape_list]
        groups = [{"params": params[::2], "weight_decay": 0.1}] + ([{"params": params[1::2], "lr": 0.02}] if len(params) > 1 else [])
        opt = zeroshard.ShardedOptimizer(torch.optim.AdamW(groups, lr=1e-2), bucket_size_mb=bucket_numel * dtype.itemsize / 2**20)
        return params, opt

    count = 0

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None)
    @given(shape_list=shapes, dtype=st.sampled_from([torch.float32, torch.bfloat16]), bucket_numel=st.integers(1, 40), steps=st.integers(0, 2))
    def check(shape_list, dtype, bucket_numel, steps):
        nonlocal count
        params, opt = build(shape_list, dtype, bucket_numel, seed=0)
        for step in range(steps):
            for i, p in enumerate(params):
                if (i + step) % 3:  # some params get no gradient in some steps
                    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i)).to(dtype)
            opt.step()
            for p in params:
                p.grad = None
        expected = _full(opt)
        sharded = copy.deepcopy(opt.state_dict())
        _, from_full = build(shape_list, dtype, bucket_numel + 7, seed=1)
        from_full.load_state_dict(copy.deepcopy(expected))
        _, from_sharded = build(shape_list, dtype, bucket_numel, seed=1)
        from_sharded.load_state_dict(sharded)
        for other in (from_full, from_sharded):
            got = _full(other)
            assert got["param_groups"] == expected["param_groups"]
            assert got["state"].keys() == expected["state"].keys()
            for index, entry in expected["state"].items():
                assert all(torch.equal(got["state"][index][k], v) for k, v in entry.items())
            assert got["zeroshard"]["master"].keys() == expected["zeroshard"]["master"].keys()
            assert all(torch.equal(got["zeroshard"]["master"][i], m) for i, m in expected["zeroshard"]["master"].items())
        count += 1

    check()
    return count


@pytest.mark.parametrize("world_size,examples", [(2, 6), (3, 4)])  # about 0.9 s (2 ranks) and 1.4 s (3) an example
def test_full_and_sharded_round_trips(pools, world_size, examples):
    assert pools[world_size].run(round_trip_worker, examples, timeout=300) == [examples] * world_size


def _full(opt) -> dict:
    """The consolidated full state dict, on every rank."""
    opt.consolidate_state_dict(to=0)
    box = [opt.state_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def frozen_later_worker(directory: str) -> list[bool]:
    """A param frozen after training started keeps its optimizer state through DCP and full dicts."""
    model, opt = _build()
    _train(model, opt, range(2))
    model.fc2.weight.requires_grad_(False)
    _train(model, opt, range(2, 3))
    dcp.save({"model": model.state_dict(), "optim": opt}, checkpoint_id=directory)
    expected = _full(opt)
    frozen = [id(p) for g in param_groups(model) for p in g["params"]].index(id(model.fc2.weight))
    results = [expected["state"][frozen]["step"].item() == 2.0]  # its two updates before freezing
    for method in ("dcp", "full"):
        fresh_model, fresh = _build(seed=1)
        fresh_model.fc2.weight.requires_grad_(False)  # the resumed script freezes it the same way
        if method == "dcp":
            dcp.load({"model": fresh_model.state_dict(), "optim": fresh}, checkpoint_id=directory)
        else:
            fresh.load_state_dict(copy.deepcopy(expected))
        got = _full(fresh)
        results.append(
            got["state"].keys() == expected["state"].keys()
            and all(torch.equal(got["state"][i][k], v) for i, entry in expected["state"].items() for k, v in entry.items())
        )
    return results


def test_state_of_params_frozen_after_training_started_survives(pools, tmp_path):
    for results in pools[2].run(frozen_later_worker, str(tmp_path)):
        assert results == [True, True, True]


def frozen_at_build_worker() -> list[str]:
    """A full dict holding state for a param frozen when the loading optimizer was built: refused (both partitions'
    formats); loaded once that param is trainable at build, or once its entry is deleted."""
    model, opt = _build()
    _train(model, opt, range(2))
    saved = _full(opt)
    index = [id(p) for g in param_groups(model) for p in g["params"]].index(id(model.fc2.weight))
    outcomes = []
    for remedy in ("none", "trainable", "deleted"):
        fresh_model = TinyNet()
        fresh_model.fc2.weight.requires_grad_(remedy == "trainable")
        fresh = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(fresh_model), lr=1e-2, foreach=False), bucket_size_mb=BUCKET_MB)
        state_dict = copy.deepcopy(saved)
        if remedy == "deleted":
            del state_dict["state"][index]
        try:
            fresh.load_state_dict(state_dict)
            outcomes.append("loaded")
        except ValueError as error:
            outcomes.append(str(error))
    return outcomes


def test_full_dict_with_state_for_a_param_frozen_at_build_is_refused(pools):
    # Before: the load dropped that param's state but kept its step count, so unfrozen later it restarted from zero moments
    # at step 3 (and the sharded format already refused the same checkpoint).
    for refused, trainable, deleted in pools[2].run(frozen_at_build_worker):
        assert "frozen (requires_grad=False) when this optimizer was built" in refused and "['params']" in refused
        assert (trainable, deleted) == ("loaded", "loaded")


def hooks_worker(directory: str) -> list[str]:
    """torch.optim's state-dict hooks run around save and load, DCP's included, with their replacements."""
    model, opt = _build()
    _train(model, opt, range(2))
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append(f"save-pre {o is opt}"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append(f"save-post {sorted(sd)}") or {**sd, "extra": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append(f"load-pre {sd.get('extra')}") or {k: v for k, v in sd.items() if k != "extra"})
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))
    assert opt.state_dict()["extra"] == 1
    opt.load_state_dict(opt.state_dict())  # the pre hook takes out what the post hook added
    dcp.save({"optim": opt}, checkpoint_id=directory)
    dcp.load({"optim": opt}, checkpoint_id=directory)
    return calls


def test_optimizer_state_dict_hooks_run(pools, tmp_path):
    for calls in pools[2].run(hooks_worker, str(tmp_path)):
        save = ["save-pre True", "save-post ['buckets', 'param_groups', 'param_steps', 'shapes', 'zeroshard']"]
        assert calls[:6] == save + save + ["load-pre 1", "load-post"], calls
        assert calls.count("load-post") == 2 and calls.count("save-pre True") >= 4, calls
