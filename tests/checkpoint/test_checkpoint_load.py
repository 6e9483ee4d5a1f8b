"""Checkpoints, continued: a load replaces the state, the checkpoint's hyperparameters decide what it
holds, and params saved with another shape are named (helpers from ``test_checkpoint.py``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from models import TinyNet, param_groups
from test_checkpoint import BUCKET_MB, _build, _full, _snapshot, _train

import zeroshard

# -- loading replaces the state; the checkpoint decides ---------------------------------------


def stale_state_worker(method: str, offload: str | None, dtype: torch.dtype, directory: str) -> bool:
    """Loading into an optimizer that has stepped gives exactly the state a fresh one gets.

    A trains without its ``branch`` (no state for it) and saves; B trains on other data with the
    branch, then loads A's checkpoint; C, freshly built, loads the same. B and C then train on,
    bitwise alike: B keeps none of its own moments, steps or masters.
    """
    model, opt = _build(dtype=dtype, offload=offload)
    _train(model, opt, range(3), use_branch=False)
    model_state = copy.deepcopy(model.state_dict())
    if method == "dcp":
        dcp.save({"model": model.state_dict(), "optim": opt}, checkpoint_id=directory)
    elif method == "sharded":
        saved = copy.deepcopy(opt.state_dict())
    else:
        saved = _full(opt)
        if method == "plain":  # as an unsharded torch.optim.AdamW saves it: no fp32 masters
            del saved["zeroshard"]
    stepped, stepped_opt = _build(dtype=dtype, offload=offload)
    _train(stepped, stepped_opt, range(100, 103))
    fresh, fresh_opt = _build(seed=1, dtype=dtype, offload=offload)
    for m, o in ((stepped, stepped_opt), (fresh, fresh_opt)):
        if method == "dcp":
            state = {"model": m.state_dict(), "optim": o}
            dcp.load(state, checkpoint_id=directory)
            m.load_state_dict(state["model"])
        else:
            m.load_state_dict(model_state)
            o.load_state_dict(copy.deepcopy(saved))
        _train(m, o, range(3, 6))
    return all(torch.equal(a, b) for a, b in zip(stepped.parameters(), fresh.parameters()))


@pytest.mark.parametrize(
    "method, offload, dtype",
    [
        ("full", None, torch.float32), ("sharded", None, torch.float32), ("dcp", None, torch.float32), ("plain", None, torch.bfloat16),
        ("dcp", "cpu", torch.float32), ("sharded", "cpu", torch.bfloat16), ("plain", "cpu", torch.bfloat16),
    ],
)
def test_load_into_stepped_optimizer_equals_load_into_fresh_one(pools, tmp_path, method, offload, dtype):
    assert all(pools[2].run(stale_state_worker, method, offload, dtype, str(tmp_path / "dcp")))


def unfrozen_resume_worker(partition: str, method: str, saved_when: str, directory: str) -> tuple[bool, str]:
    """Gradual unfreezing: ``fc2.weight`` frozen at build and unfrozen after the first step; saved after the third
    (``saved_when="after"``) or after the first, before the unfreezing (``"before"``). Resumed as the script would (built
    frozen, unfrozen, loaded) and trained to step 5: bitwise the run that went on. With DCP and a checkpoint that holds the
    unfrozen param, the first load (into a state_dict() taken before the param was sharded) raises, saying what to do; the
    second loads."""
    def build():
        torch.manual_seed(0)
        model = TinyNet()
        model.fc2.weight.requires_grad_(False)
        return model, zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), bucket_size_mb=BUCKET_MB, partition=partition)

    def save(model, opt):
        if method == "dcp":
            dcp.save({"optim": opt}, checkpoint_id=directory)
            return copy.deepcopy(model.state_dict()), None
        return copy.deepcopy(model.state_dict()), _full(opt) if method == "full" else copy.deepcopy(opt.state_dict())

    model, opt = build()
    _train(model, opt, range(1))
    if saved_when == "before":
        (model_state, saved), start = save(model, opt), 1
    model.fc2.weight.requires_grad_(True)
    _train(model, opt, range(1, 3))
    if saved_when == "after":
        (model_state, saved), start = save(model, opt), 3
    _train(model, opt, range(3, 5))
    fresh, fresh_opt = build()
    fresh.load_state_dict(model_state)
    fresh.fc2.weight.requires_grad_(True)
    first = ""
    if method == "dcp" and saved_when == "after":
        with pytest.raises(ValueError, match="taken before params unfrozen since the optimizer was built") as raised:
            dcp.load({"optim": fresh_opt}, checkpoint_id=directory)
        first = str(raised.value)
    if method == "dcp":
        dcp.load({"optim": fresh_opt}, checkpoint_id=directory)
    else:
        fresh_opt.load_state_dict(saved)
    _train(fresh, fresh_opt, range(start, 5))
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters())), first


@pytest.mark.parametrize("partition", ["flat", "param"])
@pytest.mark.parametrize("method", ["sharded", "full", "dcp"])
@pytest.mark.parametrize("saved_when", ["after", "before"])
def test_a_checkpoint_around_gradual_unfreezing_resumes_unfrozen_then_loaded(pools, tmp_path, partition, method, saved_when):
    # Before, a checkpoint saved after the unfreezing did not load: the load ran before the unfrozen param was sharded (at the
    # next backward): "state_dict has optimizer state for 9 params, this optimizer trains 8" (sharded), or "... frozen when
    # this optimizer was built" (full). One saved before it (no state for the param) loads as it did: the load shards nothing.
    for equal, first in pools[2].run(unfrozen_resume_worker, partition, method, saved_when, str(tmp_path / "dcp")):
        assert equal
        assert not first or "Take opt.state_dict() again and dcp.load into it" in first


def _frozen_fc2_and_held_group():
    """TinyNet with ``fc2.weight`` frozen, a ShardedOptimizer over its decay group, and the no-decay group held back."""
    torch.manual_seed(0)
    model = TinyNet()
    model.fc2.weight.requires_grad_(False)
    decay, no_decay = param_groups(model)
    return model, zeroshard.ShardedOptimizer(torch.optim.AdamW([decay], lr=1e-2), bucket_size_mb=BUCKET_MB), no_decay


def unfrozen_then_added_worker(method: str, directory: str) -> bool:
    """``fc2.weight`` (decay group) frozen at build and unfrozen after step 1; the no-decay group added by
    ``add_param_group`` after step 2; saved after step 3 and resumed by repeating the calls (build frozen, unfreeze, add
    the group, load): bitwise the run that went on. The unfrozen param is sharded before the added group in both runs, as
    the saving run's backward sharded it (the resumed run laid them out the other way round before)."""
    model, opt, later = _frozen_fc2_and_held_group()
    _train(model, opt, range(1))
    model.fc2.weight.requires_grad_(True)
    _train(model, opt, range(1, 2))
    opt.add_param_group(later)
    _train(model, opt, range(2, 3))
    if method == "dcp":
        dcp.save({"optim": opt}, checkpoint_id=directory)
    saved, model_state = copy.deepcopy(opt.state_dict()) if method == "sharded" else None, copy.deepcopy(model.state_dict())
    _train(model, opt, range(3, 5))
    fresh, fresh_opt, later = _frozen_fc2_and_held_group()
    fresh.load_state_dict(model_state)
    fresh.fc2.weight.requires_grad_(True)
    fresh_opt.add_param_group(later)
    if method == "dcp":
        dcp.load({"optim": fresh_opt}, checkpoint_id=directory)
    else:
        fresh_opt.load_state_dict(saved)
    _train(fresh, fresh_opt, range(3, 5))
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


@pytest.mark.parametrize("method", ["sharded", "dcp"])
def test_params_unfrozen_then_a_group_added_resume_by_repeating_the_calls(pools, tmp_path, method):
    assert all(pools[2].run(unfrozen_then_added_worker, method, str(tmp_path / "dcp")))


def other_order_worker() -> str:
    """The run of :func:`unfrozen_then_added_worker` saved after the unfreezing, resumed with the group added first and the param
    unfrozen after: its flat buffers come in another order, which the error names."""
    model, opt, later = _frozen_fc2_and_held_group()
    model.fc2.weight.requires_grad_(True)
    _train(model, opt, range(1))
    opt.add_param_group(later)
    _train(model, opt, range(1, 2))
    saved = opt.state_dict()
    fresh, fresh_opt, later = _frozen_fc2_and_held_group()
    fresh_opt.add_param_group(later)
    fresh.fc2.weight.requires_grad_(True)
    _train(fresh, fresh_opt, range(1))  # shards the unfrozen param after the added group
    with pytest.raises(ValueError, match="flat buffers in another order") as raised:
        fresh_opt.load_state_dict(saved)
    return str(raised.value)


def test_a_resume_that_unfroze_and_added_in_another_order_is_told_so(pools):
    assert all("repeat its calls in their order" in message for message in pools[2].run(other_order_worker))


def template_keys_worker() -> dict[str, list[str]]:
    keys = {}
    for partition in ("flat", "param"):
        model = TinyNet()
        sd = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2), partition=partition).state_dict()
        keys[partition] = sorted(sd) + sorted(f"zeroshard.{k}" for k in sd["zeroshard"])
    return keys


def test_the_sharded_formats_entries_are_those_of_its_version(pools):
    # dcp.load asks the checkpoint for every entry of the state_dict() it fills: an entry added without a new format version
    # makes every checkpoint saved before fail inside DCP ("Missing key in checkpoint state_dict: optim.zeroshard.keeps_step",
    # as a probe found one this session would have). Adding one takes a new SHARDED_FORMAT_VERSION and a reader of the old.
    common = ["param_groups", "param_steps", "zeroshard", "zeroshard.format", "zeroshard.layout", "zeroshard.loss_scaler",
              "zeroshard.partition", "zeroshard.rank", "zeroshard.version", "zeroshard.world_size"]
    for keys in pools[2].run(template_keys_worker):
        assert keys["flat"] == sorted(["buckets", "shapes", *common[:3]]) + sorted([*common[3:], "zeroshard.state_keys"]), keys
        assert keys["param"] == sorted(["params", *common[:3]]) + sorted([*common[3:], "zeroshard.keeps_step", "zeroshard.subclasses"]), keys


def mixed_dtype_worker() -> None:
    """An fp32 and an fp64 param group: the consolidated state equals unsharded AdamW's, bitwise, each in its own dtype."""
    torch.manual_seed(0)
    specs = [((4,), torch.float32), ((3, 3), torch.float32), ((5, 3), torch.float64), ((7,), torch.float64)]
    ref_params = [torch.nn.Parameter(torch.randn(shape, dtype=dtype)) for shape, dtype in specs]
    params = [torch.nn.Parameter(p.detach().clone()) for p in ref_params]
    ref = torch.optim.AdamW([{"params": ref_params[:2]}, {"params": ref_params[2:]}], lr=1e-2, foreach=False)
    for step in range(3):  # the same unsharded run on every rank
        for i, p in enumerate(ref_params):
            p.grad = torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(10 * step + i))
        ref.step()
    expected = ref.state_dict()
    opt = zeroshard.ShardedOptimizer(torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2), bucket_size_mb=20 * 8 / 2**20)
    opt.load_state_dict(copy.deepcopy(expected))
    got = _full(opt)
    assert got["state"].keys() == expected["state"].keys()
    for index, entry in expected["state"].items():
        for key, value in entry.items():
            assert got["state"][index][key].dtype == value.dtype, (index, key, got["state"][index][key].dtype)
            assert torch.equal(got["state"][index][key], value), (index, key)


def test_consolidate_keeps_each_param_groups_dtype(pools):
    pools[2].run(mixed_dtype_worker)


def _sgd(model, **hyperparameters):
    return zeroshard.ShardedOptimizer(torch.optim.SGD(param_groups(model), **hyperparameters), bucket_size_mb=BUCKET_MB)


def sgd_hyperparameters_worker(directory: str) -> bool:
    """A consolidated SGD(momentum=0.9) state dict loads into an optimizer built as SGD(lr=0.01), as
    into torch.optim.SGD(lr=0.01): momentum 0.9 and its buffers come back, training goes on alike."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = _sgd(model, lr=0.1, momentum=0.9)
    _train(model, opt, range(3))
    full, model_state = _full(opt), copy.deepcopy(model.state_dict())
    ref_model, resumed = TinyNet(), TinyNet()
    ref_model.load_state_dict(model_state)
    resumed.load_state_dict(model_state)
    ref = torch.optim.SGD(param_groups(ref_model), lr=0.01)
    ref.load_state_dict(copy.deepcopy(full))
    resumed_opt = _sgd(resumed, lr=0.01)
    resumed_opt.load_state_dict(copy.deepcopy(full))
    assert [g["momentum"] for g in resumed_opt.param_groups] == [0.9, 0.9]
    _train(ref_model, ref, range(3, 6))
    _train(resumed, resumed_opt, range(3, 6))
    return all(torch.equal(a, b) for a, b in zip(resumed.parameters(), ref_model.parameters()))


def test_checkpoint_hyperparameters_decide_the_state_to_load(pools, tmp_path):
    assert all(pools[1].run(sgd_hyperparameters_worker, str(tmp_path)))


def sgd_sharded_hyperparameters_worker(directory: str) -> None:
    """The same with this rank's sharded dict (bitwise against the uninterrupted run); through DCP the
    fresh optimizer cannot present momentum buffers to fill, which is refused with the way out."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = _sgd(model, lr=0.1, momentum=0.9)
    _train(model, opt, range(3))
    sharded, model_state = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    dcp.save({"optim": opt}, checkpoint_id=directory)
    _train(model, opt, range(3, 6))
    resumed = TinyNet()
    resumed.load_state_dict(model_state)
    resumed_opt = _sgd(resumed, lr=0.01)
    resumed_opt.load_state_dict(sharded)
    _train(resumed, resumed_opt, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), model.parameters()))
    fresh = _sgd(TinyNet(), lr=0.01)
    with pytest.raises(ValueError, match=r"the checkpoint holds optimizer state \['momentum_buffer'\].*Build the optimizer with the checkpoint's "
                                          "hyperparameters"):
        dcp.load({"optim": fresh}, checkpoint_id=directory)
    assert not fresh.state and fresh.param_groups[0]["momentum"] == 0


def test_checkpoint_hyperparameters_decide_the_state_to_load_sharded(pools, tmp_path):
    pools[2].run(sgd_sharded_hyperparameters_worker, str(tmp_path / "dcp"))


def _reshaped(change):
    """A TinyNet with one param replaced (same registration order) and its optimizer."""
    torch.manual_seed(0)
    model = TinyNet()
    change(model)
    return zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(model), lr=1e-2, foreach=False), bucket_size_mb=BUCKET_MB)


def _transpose_fc1(model):
    model.fc1.weight = torch.nn.Parameter(model.fc1.weight.detach().t().contiguous())


def _grow_fc2_bias(model):
    model.fc2.bias = torch.nn.Parameter(torch.zeros(14))


def _add_param(model):
    model.extra = torch.nn.Parameter(torch.zeros(3))


def reshaped_params_worker(directory: str) -> None:
    """A param saved with another shape is named, with both shapes: per-rank by zeroshard's check, through DCP by
    dcp.load's own size check at the param's shape entry (a param added: its missing shape entry), by verify_checkpoint
    before either. A version 1 dict
    (no shapes) is refused with the way out. Nothing changes on a refused load."""
    model, opt = _build()
    _train(model, opt, range(2))
    sharded = copy.deepcopy(opt.state_dict())
    dcp.save({"optim": opt}, checkpoint_id=directory)
    transposed = r"param_groups\[0\]\['params'\]\[1\] was saved with shape \(29, 13\), this model has \(13, 29\)"
    grown = r"param_groups\[1\]\['params'\]\[4\] was saved with shape \(13,\), this model has \(14,\)"
    for change, message in ((_transpose_fc1, transposed), (_grow_fc2_bias, grown)):
        other = _reshaped(change)
        with pytest.raises(ValueError, match=message):
            other.load_state_dict(copy.deepcopy(sharded))
        assert not other.state
    # Through DCP its own size check refuses it first, at the param's shape entry (see docs/checkpoint.md).
    dcp_transposed = r"saved torch.Size\(\[0, 29, 13\]\) and current: torch.Size\(\[0, 13, 29\]\) for optim.shapes.param_groups\[0\]\['params'\]\[1\]"
    dcp_grown = r"saved torch.Size\(\[0, 13\]\) and current: torch.Size\(\[0, 14\]\) for optim.shapes.param_groups\[1\]\['params'\]\[4\]"
    dcp_added = r"Missing key in checkpoint state_dict: optim.shapes.param_groups\[\d\]\['params'\]\[\d+\]"  # was: the param steps' size
    for change, message in ((_transpose_fc1, dcp_transposed), (_grow_fc2_bias, dcp_grown), (_add_param, dcp_added)):
        other = _reshaped(change)
        with pytest.raises(BaseException, match=message):
            dcp.load({"optim": other}, checkpoint_id=directory)
        assert not other.state
    for change, message in ((_transpose_fc1, transposed), (_grow_fc2_bias, grown)):  # checked first, the param is named
        with pytest.raises(ValueError, match=message):
            zeroshard.verify_checkpoint(directory, _reshaped(change))
    zeroshard.verify_checkpoint(directory, opt)
    old = copy.deepcopy(sharded)
    old["zeroshard"]["version"] = 1
    old["zeroshard"]["layout"] = [(dtype, tuple(range(len(params))), per_bucket) for dtype, params, per_bucket in old["zeroshard"]["layout"]]
    before = _snapshot(opt)
    with pytest.raises(ValueError, match=r"format version 1, whose layout signature does not record param shapes.*consolidate_state_dict"):
        opt.load_state_dict(old)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(opt)))


def test_params_saved_with_another_shape_are_named(pools, tmp_path):
    pools[2].run(reshaped_params_worker, str(tmp_path / "dcp"))


def verify_mismatch_worker(directory: str) -> None:
    """verify_checkpoint names what differs from the optimizer about to load, where dcp.load would fail inside DCP on a bucket's
    size or a missing key: params in other param groups, another partition, another optimizer class (either partition), a
    param group setting the checkpoint lacks. Its own saver passes."""
    model, opt = _build()
    _train(model, opt, range(2))
    dcp.save({"optim": opt}, checkpoint_id=directory)
    zeroshard.verify_checkpoint(directory, opt)

    def built(groups=param_groups, optimizer=torch.optim.AdamW, dtype=torch.float32, bucket_size_mb=BUCKET_MB, **options):
        torch.manual_seed(0)
        return zeroshard.ShardedOptimizer(optimizer(groups(TinyNet().to(dtype)), lr=1e-2), bucket_size_mb=bucket_size_mb, **options)

    def without_second_matrix(model):  # as filter(requires_grad) after freezing it: the params after it move up
        decay, no_decay = param_groups(model)
        return [{**decay, "params": decay["params"][:1] + decay["params"][2:]}, no_decay]

    cases = [
        (built(groups=lambda m: [{"params": list(m.parameters())}]), r"params of this model's shapes, but in other places of param_groups "
                                                                      r"\(param_groups\[0\]\['params'\]\[3\]: saved \(13, 13\), this model \(29,\)\)"),
        (built(partition="param"), r"sharded checkpoint of partition='flat', this optimizer has partition='param'"),
        (built(groups=without_second_matrix), r"optimizer state for \d+ params, this optimizer trains \d+: a param added, removed or frozen"),
        (built(dtype=torch.bfloat16), r"flat buffer 0 holds torch.float32 params, this optimizer's are torch.bfloat16: saved with the model in another dtype"),
        (built(bucket_size_mb=1.0), r"flat buffer 0 has \(.*\) params per bucket, this optimizer \(\d+,\): saved with another bucket_size_mb"),
        (built(optimizer=torch.optim.RMSprop), r"holds optimizer state \[\['exp_avg', 'exp_avg_sq'\], \['exp_avg', 'exp_avg_sq'\]\] per param "
                                               r"group; RMSprop with this optimizer's hyperparameters keeps \[\['square_avg'\], \['square_avg'\]\]"),
    ]
    named = built()
    named.param_groups[0]["name"] = "decay"  # a setting of the user's own: dcp.load asks the checkpoint for it
    cases.append((named, r"param_groups\[0\] was saved without \['name'\], which AdamW's has"))
    for other, message in cases:
        with pytest.raises(ValueError, match=message):
            zeroshard.verify_checkpoint(directory, other)
    # Settings DCP saves split ("meta.layer", "scales.0") or not at all (an empty dict) verify as they load
    settings = built()
    settings.param_groups[0].update(meta={"layer": "attn"}, empty={}, scales=[torch.tensor(1.0)])
    dcp.save({"optim": settings}, checkpoint_id=directory + "-settings")
    zeroshard.verify_checkpoint(directory + "-settings", settings)
    dcp.load({"optim": settings}, checkpoint_id=directory + "-settings")
    # partition="param" saves no state keys per group: each param's entries are compared (DCP: "Missing key" otherwise)
    dcp.save({"optim": built(partition="param")}, checkpoint_id=directory + "-param")
    zeroshard.verify_checkpoint(directory + "-param", built(partition="param"))
    for optimizer, keeps in [(torch.optim.RMSprop, r"\['square_avg'\]"), (torch.optim.SGD, r"\[\]"), (torch.optim.Adamax, r"\['exp_avg', 'exp_inf'\]")]:
        with pytest.raises(ValueError, match=r"param_groups\[\d\]\['params'\]\[\d\] was saved with optimizer state \['exp_avg', 'exp_avg_sq'\]; "
                                             rf"{optimizer.__name__} with this optimizer's hyperparameters keeps {keeps}: saved by another optimizer class"):
            zeroshard.verify_checkpoint(directory + "-param", built(optimizer=optimizer, partition="param"))
    # bf16 saved without masters, verified against an optimizer that keeps them (the other way round loads: masters dropped)
    torch.manual_seed(0)
    bf16 = TinyNet().to(torch.bfloat16)
    saved = zeroshard.ShardedOptimizer(torch.optim.AdamW(param_groups(bf16), lr=1e-2), bucket_size_mb=BUCKET_MB, master_weights=False)
    dcp.save({"optim": saved}, checkpoint_id=directory + "-bf16")
    with pytest.raises(ValueError, match=r"no fp32 masters of 16-bit params, this optimizer keeps them. The checkpoint was saved with master_weights=False"):
        zeroshard.verify_checkpoint(directory + "-bf16", built(dtype=torch.bfloat16))
    zeroshard.verify_checkpoint(directory + "-bf16", saved)


def test_verify_checkpoint_names_what_differs(pools, tmp_path):
    pools[2].run(verify_mismatch_worker, str(tmp_path / "dcp"))


class HeavySGD(torch.optim.SGD):
    """SGD whose momentum comes from a constructor option it keeps as an attribute, not a param-group key it takes."""

    def __init__(self, params, lr: float = 0.1, heavy: bool = False):
        super().__init__(params, lr=lr, momentum=0.9 if heavy else 0.0)
        self.heavy = heavy


def instance_option_worker(method: str) -> bool:
    """An optimizer whose state depends on an option kept as an attribute (``HeavySGD(heavy=True)``: ``momentum_buffer``),
    saved after 2 steps and loaded into a fresh one, then one more step each: whether the params are bitwise alike."""
    models, opts = [], []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(TinyNet())
        opts.append(zeroshard.ShardedOptimizer(HeavySGD(param_groups(models[-1]), heavy=True), bucket_size_mb=BUCKET_MB, partition="flat"))
    _train(models[0], opts[0], range(2))
    saved = copy.deepcopy(opts[0].state_dict()) if method == "sharded" else _full(opts[0])
    models[1].load_state_dict(models[0].state_dict())
    opts[1].load_state_dict(saved)
    for model, opt in zip(models, opts):
        _train(model, opt, range(2, 3))
    return all(torch.equal(a, b) for a, b in zip(*(m.parameters() for m in models)))


@pytest.mark.parametrize("method", ["sharded", "full"])
def test_state_an_attribute_option_decides_is_saved(pools, method):
    # The flat partition's checkpoints left momentum_buffer out: the state keys were probed without the option.
    assert all(pools[2].run(instance_option_worker, method))
