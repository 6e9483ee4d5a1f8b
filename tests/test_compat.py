"""Every private torch internal in ``zeroshard/compat.py`` exists and behaves as zeroshard uses it.

A torch release that removes or changes one fails here, naming the torch version and the internal, before
the failure shows up as a wrong number or a hang somewhere in the suite.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.overrides import TorchFunctionMode

from zeroshard import compat

TORCH = f"torch {torch.__version__}"


class _Counting(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_the_torch_function_mode_stack_can_be_pushed_and_popped_by_hand():
    mode = _Counting()
    assert compat.function_mode_stack() == [], f"{TORCH}: a mode is active before the test"
    compat.push_function_mode(mode)
    try:
        assert compat.function_mode_stack() == [mode], f"{TORCH}: _push_mode no longer puts the mode on _get_current_function_mode_stack()"
        torch.ones(2).add(1)
        assert mode.calls > 0, f"{TORCH}: a mode pushed with _push_mode does not see torch calls"
    finally:
        compat.pop_function_mode()
    assert compat.function_mode_stack() == [], f"{TORCH}: _pop_mode left the mode on the stack"


def test_disabling_torch_function_skips_subclasses_and_modes():
    class Sub(torch.Tensor):
        calls = 0

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.calls += 1
            return super().__torch_function__(func, types, args, kwargs or {})

    t = torch.ones(3).as_subclass(Sub)
    with compat.DisableTorchFunctionSubclass():
        t.add(1)
    assert Sub.calls == 0, f"{TORCH}: DisableTorchFunctionSubclass no longer skips a subclass's __torch_function__"
    mode = _Counting()
    with mode, compat.DisableTorchFunction():
        torch.ones(2).add(1)
    assert mode.calls == 0, f"{TORCH}: DisableTorchFunction no longer skips torch-function modes"


def test_the_fused_adam_kernels_are_the_ones_adamw_fused_runs():
    for adamw, cls in ((True, torch.optim.AdamW), (False, torch.optim.Adam)):
        torch.manual_seed(0)
        param, grad = torch.randn(37), torch.randn(37)
        reference = param.clone().requires_grad_()
        reference.grad = grad.clone()
        cls([reference], lr=1e-2, weight_decay=0.1, fused=True).step()
        exp_avg, exp_avg_sq, step = torch.zeros(37), torch.zeros(37), torch.tensor(1.0)
        kernel = compat.fused_adamw_ if adamw else compat.fused_adam_
        kernel([param], [grad], [exp_avg], [exp_avg_sq], [], [step], amsgrad=False, lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1,
               eps=1e-8, maximize=False)
        assert torch.equal(param, reference.detach()), f"{TORCH}: torch._fused_{'adamw' if adamw else 'adam'}_ differs from {cls.__name__}(fused=True)"
    grads = [torch.randn(5), torch.randn(7)]
    assert all(torch.allclose(n, torch.linalg.vector_norm(g)) for n, g in zip(compat.foreach_norm(grads, 2), grads)), f"{TORCH}: torch._foreach_norm"
    tensors = [torch.ones(2), torch.ones(3)]
    compat.foreach_mul_(tensors, 3.0)
    compat.foreach_copy_(tensors, [torch.full((2,), 5.0), torch.full((3,), 7.0)])
    assert tensors[0].tolist() == [5.0, 5.0] and tensors[1].tolist() == [7.0] * 3, f"{TORCH}: torch._foreach_copy_"


def test_optimizer_hook_registries_are_the_ones_its_public_methods_fill():
    opt = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
    for name in compat.OPTIMIZER_HOOK_DICTS:
        assert isinstance(getattr(opt, name, None), OrderedDict), f"{TORCH}: torch.optim.Optimizer has no {name}"
    opt.register_step_pre_hook(lambda *a: None)
    opt.register_load_state_dict_post_hook(lambda *a: None)
    assert len(opt._optimizer_step_pre_hooks) == 1 and len(opt._optimizer_load_state_dict_post_hooks) == 1, TORCH


def test_the_current_autograd_node_is_known_inside_a_backward_only():
    seen = []
    x = torch.ones(2, requires_grad=True)
    x.register_hook(lambda g: seen.append(compat.current_autograd_node()))
    (x * 2).sum().backward()
    assert seen and seen[0] is not None, f"{TORCH}: torch._C._current_autograd_node() is None inside a gradient hook"
    assert compat.current_autograd_node() is None, f"{TORCH}: torch._C._current_autograd_node() outside a backward"


def test_post_accumulate_grad_hook_ids_follow_registration_order():
    param = nn.Parameter(torch.ones(2))
    assert compat.last_post_accumulate_grad_hook_id(param) is None, TORCH
    first = param.register_post_accumulate_grad_hook(lambda p: None)
    second = param.register_post_accumulate_grad_hook(lambda p: None)
    assert compat.post_accumulate_grad_hook_ids(param) == [first.id, second.id], f"{TORCH}: Tensor._post_accumulate_grad_hooks"
    assert compat.last_post_accumulate_grad_hook_id(param) == second.id, TORCH
    second.remove()
    assert compat.post_accumulate_grad_hook_ids(param) == [first.id], TORCH
    assert compat.last_post_accumulate_grad_hook_id(param) == first.id, TORCH


def test_the_version_counter_moves_as_zeroshard_reads_it():
    """``Tensor._version`` (see compat.py): in-place writes, views, ``p.data =`` bindings, gradient accumulation."""
    flat = torch.zeros(6)
    param = nn.Parameter(torch.ones(2, 2))
    param.data = flat[1:5].view_as(param)
    before, flat_before = param._version, flat._version
    flat.add_(1.0)  # the optimizer's write to the flat buffer
    assert param._version == before, f"{TORCH}: a write to the flat buffer moved the version of a param bound with p.data ="
    with torch.no_grad():
        param.mul_(2.0)  # a user's write to the param
    assert param._version > before, f"{TORCH}: an in-place write to a param left Tensor._version unchanged"
    flat[2:4].add_(1.0)
    assert flat._version > flat_before + 1, f"{TORCH}: a write through a view did not move its base's Tensor._version"
    grads = torch.zeros(4)
    param.grad = grads.view(2, 2)
    seen = grads._version
    (param * 3.0).sum().backward()
    assert param.grad is not None and param.grad.data_ptr() == grads.data_ptr(), f"{TORCH}: autograd replaced a .grad view instead of adding into it"
    assert grads._version > seen, f"{TORCH}: autograd's accumulation into .grad left Tensor._version unchanged"


def test_a_dcp_checkpoint_loads_without_a_process_group(tmp_path):
    dcp.save({"w": torch.arange(6.0), "step": 3}, checkpoint_id=str(tmp_path), no_dist=True)
    state: dict = {}
    compat.load_checkpoint_without_process_group(state, str(tmp_path))
    assert torch.equal(state["w"], torch.arange(6.0)) and state["step"] == 3, f"{TORCH}: DCP's _load_state_dict / _EmptyStateDictLoadPlanner"


def test_make_subclass_views_the_storage_without_a_copy():
    class Sub(torch.Tensor):
        pass

    base = torch.arange(4.0)
    sub = compat.make_subclass(Sub, base)
    assert type(sub) is Sub and sub.data_ptr() == base.data_ptr(), f"{TORCH}: Tensor._make_subclass no longer views the storage"


def test_the_ddp_internals_the_wrapper_surgery_uses_exist():
    """``zeroshard/reduce/ddp.py`` switches a DistributedDataParallel's reducer off and rebuilds it on ``close()``
    through these private members of DDP, its C++ reducer and logger, and torch.distributed's comm-hook registration."""
    import inspect

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from zeroshard.reduce.ddp import _REBUILD_API

    for name, parameters in _REBUILD_API.items():
        method = getattr(DistributedDataParallel, name, None)
        assert method is not None, f"{TORCH}: DistributedDataParallel.{name} is gone"
        assert list(inspect.signature(method).parameters)[1:] == parameters, f"{TORCH}: DistributedDataParallel.{name} changed its parameters"
    for owner, names in ((dist.Reducer, ("_remove_autograd_hooks", "_set_static_graph")),
                         (dist.Logger, ("_get_ddp_logging_data", "_set_comm_hook_name", "_set_static_graph")),
                         (dist, ("_register_comm_hook", "_register_builtin_comm_hook"))):
        missing = [n for n in names if not hasattr(owner, n)]
        assert not missing, f"{TORCH}: {getattr(owner, '__name__', owner)} lacks {missing}"
    source = inspect.getsource(DistributedDataParallel)
    for attribute in ("self._has_rebuilt_buckets", "self._static_graph_delay_allreduce_enqueued", "self._lazy_init_ran = True"):
        assert attribute in source, f"{TORCH}: DistributedDataParallel no longer sets {attribute}"


def test_a_pre_hook_tells_backward_from_autograd_grad():
    """grad_reducer.py changes ``.grad`` in a param's tensor pre-hook only where autograd then accumulates into it."""
    param = torch.nn.Parameter(torch.ones(3))
    seen: list[bool] = []
    param.register_hook(lambda grad: seen.append(compat.accumulates_into_grad(param, compat.current_graph_task())))
    (param * 2).sum().backward()
    torch.autograd.grad((param * 2).sum(), [param])
    assert seen == [True, False], f"torch {torch.__version__}: _will_engine_execute_node / _current_graph_task_id changed ({seen})"


def test_each_backward_pass_has_a_graph_task_of_its_own():
    """grad_reducer.py checks whether params moved at the first gradient of each backward pass, told apart by task id."""
    param = torch.nn.Parameter(torch.ones(3))
    seen: list[int] = []
    param.register_hook(lambda grad: seen.append(compat.current_graph_task()))
    for _ in range(2):
        (param * 2).sum().backward()
    assert compat.current_graph_task() == -1 and seen[0] >= 0 and seen[1] != seen[0], f"torch {torch.__version__}: _current_graph_task_id changed ({seen})"


def test_a_scheduler_reads_the_step_mark_that_note_step_sets():
    import warnings

    for noted in (False, True):
        opt = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        if noted:
            compat.note_step(opt)  # what zeroshard's fused update does in place of opt.step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            schedule.step()
        warned = any("lr_scheduler.step()` before `optimizer.step()" in str(w.message) for w in caught)
        assert warned is not noted, f"torch {torch.__version__}: LRScheduler no longer reads optimizer._opt_called"


def test_step_with_own_hooks_runs_the_optimizers_hooks_and_step_but_not_the_global_ones():
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    param = nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    opt = torch.optim.SGD([param], lr=0.5)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", args)))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", args)))
    handle = register_optimizer_step_pre_hook(lambda o, args, kwargs: calls.append(("global", args)))
    try:
        compat.step_with_own_hooks(opt)
    finally:
        handle.remove()
    step = type(opt).step
    assert getattr(step, "hooked", False) and hasattr(step, "__wrapped__"), f"torch {torch.__version__}: Optimizer.profile_hook_step changed"
    assert calls == [("pre", (opt,)), ("post", (opt,))], f"torch {torch.__version__}: {calls}"
    assert torch.equal(param.detach(), torch.full((2,), 0.5)) and opt._opt_called  # the step ran, and was noted
    # A step patched on the instance (by a library) is called as it is; an LR scheduler's patch is not needed (note_step).
    patched = []
    opt.step = lambda *args, **kwargs: patched.append(args)
    compat.step_with_own_hooks(opt)
    assert patched == [()]
    # Patched as a method, then wrapped by a scheduler: the patch still runs (the scheduler's wrapper calls it).
    import types

    again = torch.optim.SGD([param], lr=0.5)
    again.step = types.MethodType(lambda self, *args, **kwargs: patched.append("method"), again)
    torch.optim.lr_scheduler.LambdaLR(again, lambda step: 1.0)
    assert getattr(again.step, "_wrapped_by_lr_sched", False), f"torch {torch.__version__}: LRScheduler no longer marks its step patch"
    compat.step_with_own_hooks(again)
    assert patched == [(), "method"] and again._opt_called


def test_compiling_is_true_while_dynamo_compiles_a_frame_only():
    seen = []

    def backend(graph, example_inputs):
        seen.append(compat.compiling())  # Dynamo's own Python, as when it describes a param's .grad
        return graph

    assert not compat.compiling(), f"{TORCH}: compat.compiling() outside torch.compile"
    torch.compile(lambda x: x * 2, backend=backend)(torch.ones(2))
    assert seen == [True], f"{TORCH}: torch._guards.TracingContext is not set while Dynamo compiles a frame"


def test_compiled_module_tells_a_compiled_call_from_an_eager_one():
    eager, in_place = nn.Linear(2, 2), nn.Linear(2, 2)
    in_place.compile(backend="eager")
    assert not compat.compiled_module(eager), f"{TORCH}: compat.compiled_module() on an eager module"
    assert compat.compiled_module(torch.compile(eager, backend="eager")), f"{TORCH}: torch._dynamo.eval_frame.OptimizedModule is gone"
    assert compat.compiled_module(in_place), f"{TORCH}: nn.Module.compile() no longer sets _compiled_call_impl"
