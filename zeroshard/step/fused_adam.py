"""The fused Adam/AdamW update over this rank's chunks: the math as free functions, one class to orchestrate.

The moments live in one flat buffer per chunk, the wrapped optimizer's state entries are views of them, and the update runs
over whole runs of pieces: :func:`device_adam` on the device, :func:`host_adam` for chunks in host memory. See docs/numerics.md,
"One step", docs/offload.md, and [Note: zeroshard buffers] in ``zeroshard/layout/flat_buffer.py`` for chunks and runs.
"""

from __future__ import annotations

import math
import operator
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.optim.adam import adam as torch_functional_adam
from torch.optim.adamw import adamw as torch_functional_adamw

from zeroshard import compat
from zeroshard.kernels import fused_adamw_
from zeroshard.layout.chunk import Chunk, chunks_of
from zeroshard.layout.local_shard import LocalShard
from zeroshard.offload.pipeline import CPU_ADAM_RANGE, OffloadPipeline
from zeroshard.offload.placement import MemoryTracer, Placement, place_chunks


class Run(NamedTuple):
    """1-D views of one run of adjacent pieces of one chunk, all of the same length (master dtype but ``param_out``)."""

    param: Tensor  # the master weights, updated in place
    grad: Tensor  # the gradient: the grad shard's, or the chunk's host copy
    exp_avg: Tensor  # the chunk's moments, updated in place
    exp_avg_sq: Tensor
    # the flat param buffer's elements (16-bit) to receive the cast of the updated master, or None (fp32 params, whose buffer is
    # param; host chunks, copied back by the offload pipeline)
    param_out: Tensor | None
    step: int  # the pieces' step number after this update (>= 1)


class _Bound(NamedTuple):
    """A chunk as :meth:`FusedAdam.bind` left it: its moments, each piece's state, and where its moment entries point (a state
    tensor given new storage in place, by ``.data =`` or ``set_``, keeps its identity but not its address)."""

    exp_avg: Tensor | None
    exp_avg_sq: Tensor | None
    states: list[dict | None]
    addresses: list[int]  # per piece, the data pointers of exp_avg then exp_avg_sq (0, 0 without state)

    @staticmethod
    def of(chunk: Chunk, states: list[dict | None]) -> _Bound:
        return _Bound(chunk.exp_avg, chunk.exp_avg_sq, states, _addresses(states))

    def matches(self, chunk: Chunk, states: list[dict | None]) -> bool:
        """Whether ``chunk``'s moments and the pieces' ``states`` are the objects bound, their moment entries where bound."""
        return (self.exp_avg is chunk.exp_avg and self.exp_avg_sq is chunk.exp_avg_sq and all(map(operator.is_, states, self.states))
                and _addresses(states) == self.addresses)


def _addresses(states: list[dict | None]) -> list[int]:
    return [state[key].data_ptr() if state else 0 for state in states for key in ("exp_avg", "exp_avg_sq")]


def fused_adam_kind(optimizer: torch.optim.Optimizer) -> str | None:
    """``"adamw"`` or ``"adam"`` when ``optimizer`` can take the fused path, else ``None``."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or fused_refusal(optimizer.param_groups) is not None:
        return None
    decoupled = type(optimizer) is torch.optim.AdamW or optimizer.defaults.get("decoupled_weight_decay", False)
    return "adamw" if decoupled else "adam"


def fused_refusal(param_groups: list[dict[str, Any]]) -> str | None:
    """The first setting of ``param_groups`` the fused update does not take, named, or ``None``."""
    for g, group in enumerate(param_groups):
        if missing := [key for key in ("lr", "betas", "eps", "weight_decay") if key not in group]:
            return f"param_groups[{g}] has no {missing}"
        if flags := [key for key in ("amsgrad", "capturable", "differentiable") if group.get(key)]:
            return f"param_groups[{g}][{flags[0]!r}]=True"
        if isinstance(group["lr"], Tensor) or any(isinstance(b, Tensor) for b in group["betas"]):
            return f"param_groups[{g}]: a tensor lr or betas"
    return None


def functional_adam(runs: list[Run], group: dict, adamw: bool, foreach: bool | None, fused: bool | None) -> None:
    """torch's functional Adam/AdamW (``adamw``: decoupled weight decay) over ``runs`` (on one device) in place, one call per
    step count, with the param ``group``'s hyperparameters and torch's implementation flags as the user configured them."""
    for step in sorted({run.step for run in runs}):
        batch = [run for run in runs if run.step == step]
        (torch_functional_adamw if adamw else torch_functional_adam)(
            [r.param for r in batch], [r.grad for r in batch], [r.exp_avg for r in batch], [r.exp_avg_sq for r in batch], [],
            # torch advances them to ``step``; fused kernels read them on the params' device, in fp32 (as torch's Adam keeps them)
            [torch.tensor(float(step - 1), dtype=torch.float32 if fused else None, device=r.param.device if fused else None) for r in batch],
            foreach=foreach, fused=fused, grad_scale=None, found_inf=None, amsgrad=False,
            beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=group.get("maximize", False),
        )


def host_adam(runs: list[Run], group: dict, adamw: bool, grad_scale: Tensor | None = None) -> None:
    """torch's fused CPU Adam/AdamW kernel over ``runs`` (host memory) in place, in one call.

    The kernel ``AdamW(fused=True).step()`` ends in, with the same arguments (bitwise equal), minus the functional wrapper's
    work (about 15 µs per chunk on 2 EPYC cores). Runs of different step counts share the call. ``group``: as for
    :func:`functional_adam`; ``grad_scale``: a 1-element fp32 tensor the gradients are divided by as read, or ``None``.
    """
    # 0-D fp32 step tensors, one per step count, holding the step after this update (as torch's state["step"] at the call).
    steps = {step: torch.scalar_tensor(float(step), dtype=torch.float32) for step in {run.step for run in runs}}
    (compat.fused_adamw_ if adamw else compat.fused_adam_)(
        [r.param for r in runs], [r.grad for r in runs], [r.exp_avg for r in runs], [r.exp_avg_sq for r in runs], [],
        [steps[r.step] for r in runs], amsgrad=False, lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
        weight_decay=group["weight_decay"], eps=group["eps"], maximize=group.get("maximize", False), grad_scale=grad_scale, found_inf=None,
    )


def device_adam(runs: list[Run], group: dict, multiplier: float | Tensor, adamw: bool, device: torch.device,
                found_inf: Tensor | None = None) -> None:
    """One Adam/AdamW step in place over ``runs`` on ``device``, the gradients multiplied by ``multiplier``.

    CUDA: :func:`~zeroshard.kernels.fused_adamw_` per run, writing ``param_out`` in the same pass. Elsewhere, and for fp64:
    the gradients are multiplied in place (they are consumed), :func:`functional_adam` runs, and ``param_out`` receives the
    cast of the master. Where :func:`takes_device_scalars`, ``multiplier`` may be a 1-element fp32 device tensor and
    ``found_inf`` a 1-element fp32 device flag (non-zero: leave everything untouched): nothing is read back to the host.
    """
    fp64 = bool(runs) and runs[0].grad.dtype == torch.float64  # (one shard's runs share a dtype)
    backend = _kernel_backend(device, fp64)
    if backend is not None:
        # The kernel always multiplies, also by 1.0: its variant without a multiplier rounds differently on a GPU (up to 1 ulp,
        # H100), and a step deciding on the device cannot know that its multiplier is 1.0 (no clip, or a clip coefficient of
        # 1): its update must be the host-decided step's to the bit.
        grad_scale = multiplier if isinstance(multiplier, Tensor) else torch.full((1,), multiplier, device=device, dtype=torch.float32)
        for run in runs:
            fused_adamw_(
                run.param, run.grad, run.exp_avg, run.exp_avg_sq, lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                eps=group["eps"], weight_decay=group["weight_decay"], step=run.step, grad_scale=grad_scale, found_inf=found_inf,
                param_out=run.param_out, maximize=group.get("maximize", False), adamw=adamw, backend=backend,
            )
        return
    if found_inf is not None or isinstance(multiplier, Tensor):
        raise RuntimeError("internal error: a device multiplier or overflow flag for an update off the Triton kernel (see takes_device_scalars)")
    if multiplier != 1.0:
        grad_scale = torch.full((1,), multiplier, device=device, dtype=torch.float64 if fp64 else torch.float32)
        for run in runs:
            run.grad.mul_(grad_scale)
    functional_adam(runs, group, adamw, foreach=group.get("foreach"), fused=group.get("fused"))
    for run in runs:
        if run.param_out is not None:
            run.param_out.copy_(run.param)


# Tests set it to run the Triton kernel on CPU chunks under TRITON_INTERPRET=1, so that the step
# that keeps its overflow decision on the device (takes_device_scalars) runs without a GPU.
KERNEL_ON_CPU = False


def _kernel_backend(device: torch.device, fp64: bool) -> str | None:
    """The kernels' backend for a device chunk's update, or ``None`` for torch's functional Adam."""
    if fp64:
        return None
    if device.type == "cuda":
        return "auto"
    return "triton" if KERNEL_ON_CPU and device.type == "cpu" else None


def takes_device_scalars(shards: list[LocalShard]) -> bool:
    """Whether every chunk's update runs the Triton kernel, which reads the multiplier and the overflow flag from the device."""
    return all(not chunk.on_host and _kernel_backend(chunk.device, chunk.grad.dtype == torch.float64) is not None
               for shard in shards for chunk in shard.chunks)


class FusedAdam:
    """The fused update of every chunk (``kind``: :func:`fused_adam_kind` of the wrapped ``optimizer``). The moments belong to
    the chunks: this class allocates them on first use and keeps each piece's ``state["exp_avg"]`` and ``state["exp_avg_sq"]`` views of them.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str) -> None:
        self.optimizer = optimizer
        self.adamw = kind == "adamw"
        self._pipeline = OffloadPipeline()
        self.placement: Placement | None = None  # where place_once put the chunks
        self._margin: tuple[MemoryTracer, float, torch.device] | None = None  # (tracer, ratio, device) until place_once
        # Per chunk, what bind() left: while all of it is unchanged, every piece's state views its moments.
        self._bound: weakref.WeakKeyDictionary[Chunk, _Bound] = weakref.WeakKeyDictionary()
        self._checked: set[int] = set()  # ids of the shards check_state() bound in this step (step() binds the others)

    @torch.no_grad()
    def bind(self, shards: list[LocalShard], param_steps: list[int] | None = None) -> None:
        """Allocate every chunk's moments where missing; make each piece's state a view of them (copying in a state entry that
        is not one yet: fresh from ``load_state_dict``, or left behind by a chunk that moved). Nothing changed since the last
        call (the common case) costs an identity and an address check over lists (:class:`_Bound`), no work per piece (#27).

        Raises:
            RuntimeError: with ``param_steps`` (per ``torch.optim`` param index, its updates so far), a piece of a param
                already updated has no state: user code removed it (``optimizer.state.clear()``, a new ``defaultdict``),
                which torch's Adam would restart from zero moments and step 1; the moments here and the replicated step
                counts cannot restart for one rank's pieces alone.
        """
        for shard in shards:
            for chunk in shard.chunks:
                chunk.allocate_moments()
                states = list(map(self.optimizer.state.get, chunk.virtual_params))
                bound = self._bound.get(chunk)
                if bound is not None and bound.matches(chunk, states):
                    continue
                for piece, state in zip(chunk.pieces, states):
                    if not state:
                        if param_steps is not None and param_steps[shard.param_indices[piece.param]]:
                            raise RuntimeError(
                                f"{shard.buffer.names[piece.param]} has no optimizer state after "
                                f"{param_steps[shard.param_indices[piece.param]]} updates: it was removed (optimizer.state.clear() "
                                "or a new state dict), or a full-format checkpoint loaded while the param was frozen carried none "
                                "for it. zeroshard keeps the moments in its own buffers and cannot restart them from zero: to reset "
                                "the optimizer state, build a new optimizer and ShardedOptimizer (or load_state_dict() a saved state)")
                        continue
                    for key in ("exp_avg", "exp_avg_sq"):
                        moments = getattr(chunk, key)
                        # Where the view would start, without making it (two aten ops per piece otherwise).
                        if state[key].data_ptr() != moments.data_ptr() + chunk.offset_of(piece) * moments.element_size():
                            view = chunk.shaped(piece, moments)
                            view.copy_(state[key].reshape(view.shape))
                            state[key] = view
                self._bound[chunk] = _Bound.of(chunk, states)

    def check_state(self, shards: list[LocalShard], param_steps: list[int]) -> None:
        """Before a step's collectives: raise on a setting the fused update cannot run (set since construction, by
        ``add_param_group`` or by hand); :meth:`bind`, raising where user code removed the state of a param already updated
        (each rank checks the pieces it holds; one that holds none goes on into the statistics' all-reduce, where
        ``collective_timeout_s`` names the wait). No binding while the first step's margin is traced (:meth:`place_once` binds).

        Raises:
            ValueError: see :func:`fused_refusal`.
            RuntimeError: see :meth:`bind`.
        """
        if refused := fused_refusal(self.optimizer.param_groups):
            raise ValueError(f"{refused}: the fused Adam/AdamW update chosen at construction cannot run it; wrap an optimizer built so")
        self._checked = set()
        if self._margin is None:
            self.bind(shards, param_steps)
            self._checked = {id(shard) for shard in shards}

    def start_margin_trace(self, device: torch.device, ratio: float) -> None:
        """Measure from now to the first step for ``gpu_margin_mem_ratio`` = ``ratio`` (> 0); :meth:`place_once` then places the chunks."""
        tracer = MemoryTracer(device, sample_interval_s=0.01).start()
        weakref.finalize(self, tracer.cancel)  # dropped before its first step: stop sampling
        self._margin = (tracer, ratio, device)

    @torch.no_grad()
    def place_once(self, shards: list[LocalShard], model_data_bytes: Callable[[], int]) -> Placement | None:
        """At the first step after :meth:`start_margin_trace`: end its tracer and move ``ratio`` of the measured margin's worth of
        chunks to the device (:func:`~zeroshard.offload.placement.place_chunks`; ``model_data_bytes()``: what the optimizer owns
        there), masters refreshed and moments allocated first. The new :attr:`placement`, or ``None`` (no trace started, or placed already).
        """
        if self._margin is None:
            return None
        tracer, ratio, device = self._margin
        self._margin = None
        tracer.stop()
        data_bytes = model_data_bytes()
        for shard in shards:
            shard.refresh_master()
        self.bind(shards)
        self.placement = place_chunks(chunks_of(shards), tracer, data_bytes, ratio, device)
        self.bind(shards)
        return self.placement

    @torch.no_grad()
    def load(self, shards: list[LocalShard]) -> None:
        """Take the state the wrapped optimizer has just loaded: every moment buffer is zeroed and each loaded piece's state
        copied in, so pieces without loaded state start from zero, as in a freshly built optimizer."""
        for chunk in chunks_of(shards):
            if chunk.exp_avg is not None and chunk.exp_avg_sq is not None:
                chunk.exp_avg.zero_()
                chunk.exp_avg_sq.zero_()
        self.bind(shards)

    @torch.no_grad()
    def step(self, shards: list[LocalShard], steps: list[list[int]], multiplier: float | Tensor, found_inf: Tensor | None = None) -> None:
        """Update every used piece of every shard; afterwards each chunk's slice of the flat param buffer holds its updated params.

        Unused pieces and their state stay untouched. The host chunks' gradient copies are queued first, then the device
        chunks' updates launched, then the host chunks take the CPU update one by one between their copies (docs/offload.md).

        Args:
            shards: this rank's shards (each knows its param group, whose hyperparameters apply).
            steps: per shard, per param: its step number after this update (the optimizer's replicated host count), or 0
                when it got no gradient on any rank.
            multiplier: what the gradients are multiplied by (``1/loss_scale`` times the clip coefficient), folded into the
                update; a device tensor only with ``found_inf``.
            found_inf: the device's overflow flag (non-zero: the update leaves everything untouched), where
                :func:`takes_device_scalars`; else ``None``.
        """
        device_runs: dict[int, list[Run]] = defaultdict(list)  # per shard
        host_runs: dict[Chunk, list[Run]] = defaultdict(list)  # per host chunk, in layout order
        for k, shard in enumerate(shards):
            if id(shard) not in self._checked:  # bound since check_state() otherwise (shards added in between are not)
                self.bind([shard])
            for chunk in shard.chunks:
                for run in self._runs(chunk, steps[k]):
                    (host_runs[chunk] if chunk.on_host else device_runs[k]).append(run)
        self._checked = set()
        self._pipeline.start(list(host_runs))
        for k, runs in device_runs.items():
            group = self.optimizer.param_groups[shards[k].group]  # a loaded decay style wins, as in torch
            device_adam(runs, group, multiplier, group.get("decoupled_weight_decay", self.adamw), shards[k].grad_shard.device, found_inf)
        # torch's fused kernel divides the gradients by grad_scale as it reads them: no extra pass
        # (inf for a multiplier of 0: a clip coefficient of 0, see zeroshard/clip.py).
        grad_scale = None if not host_runs or multiplier == 1.0 else torch.tensor(1.0 / multiplier if multiplier else math.inf)
        for k, shard in enumerate(shards):
            for chunk in shard.chunks:
                chunk_runs = host_runs.get(chunk)
                if chunk_runs is not None:
                    self._pipeline.receive_grad(chunk)
                    scale = grad_scale
                    if scale is not None and chunk_runs[0].grad.dtype == torch.float64:
                        # The kernel reads grad_scale as fp32: multiply fp64 gradients exactly first, as torch's clipping does.
                        compat.foreach_mul_([run.grad for run in chunk_runs], multiplier)
                        scale = None
                    with torch.profiler.record_function(CPU_ADAM_RANGE):
                        group = self.optimizer.param_groups[shards[k].group]
                        host_adam(chunk_runs, group, group.get("decoupled_weight_decay", self.adamw), scale)
                    self._pipeline.send_params(chunk)
        self._pipeline.finish()

    @torch.no_grad()
    def undo_step_counts(self, shards: list[LocalShard], steps: list[list[int]]) -> None:
        """After an update the device skipped (overflow): each piece stepped to ``steps`` (as given to :meth:`step`) gets one less."""
        for shard, shard_steps in zip(shards, steps):
            for chunk in shard.chunks:
                for piece, vparam in zip(chunk.pieces, chunk.virtual_params):
                    if shard_steps[piece.param]:
                        self.optimizer.state[vparam]["step"].fill_(shard_steps[piece.param] - 1)

    def _runs(self, chunk: Chunk, steps: list[int]) -> Iterator[Run]:
        """The runs of ``chunk``; records the new step of every used piece in its state.

        Steps come from the host counts in ``steps`` (per param of the shard), never from ``state["step"]`` (which torch may
        keep on the device). On CPU a piece joins a run only where the run so far is a whole number of 64-byte cache lines, so
        each element takes the path (vector body or scalar tail) of torch's per-param fused step (docs/numerics.md, "What is bitwise").
        """
        pieces = chunk.pieces
        chunk_steps = [steps[piece.param] for piece in pieces]
        step = chunk_steps[0] if pieces else 0
        bound = self._bound.get(chunk)  # bind() has just run
        if step and chunk_steps.count(step) == len(pieces) and bound is not None and all(bound.states):
            # The common case: every piece used, at one step count, with its state: the layout's runs, no work per piece.
            compat.foreach_copy_([state["step"] for state in bound.states if state], [torch.scalar_tensor(float(step))] * len(pieces))
            for first, end in chunk.runs(self._unit(chunk)):
                yield self._run(chunk, first, end, step)
            return
        unit = self._unit(chunk)
        start: int | None = None  # the current run's first piece
        run_step = 0  # the current run's step
        counts: dict[int, list[Tensor]] = defaultdict(list)  # step -> the state["step"] tensors to set to it
        for i, (piece, vparam) in enumerate(zip(chunk.pieces, chunk.virtual_params)):
            step = steps[piece.param]
            if start is not None and (step != run_step or chunk.breaks_run(start, i, unit)):  # the run ends here
                yield self._run(chunk, start, i, run_step)
                start = None
            if not step:
                continue
            state = self.optimizer.state[vparam]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = chunk.shaped(piece, chunk.exp_avg)
                state["exp_avg_sq"] = chunk.shaped(piece, chunk.exp_avg_sq)
            counts[step].append(state["step"])
            if start is None:
                start, run_step = i, step
        for step, tensors in counts.items():  # one operator per step count, not one per piece
            compat.foreach_copy_(tensors, [torch.scalar_tensor(float(step))] * len(tensors))
        if start is not None:
            yield self._run(chunk, start, len(chunk.pieces), run_step)

    @staticmethod
    def _unit(chunk: Chunk) -> int:
        """How many elements a run must hold, in multiples, before another piece may join it: a cache line on CPU (see :meth:`_runs`)."""
        return 64 // chunk.master_dtype.itemsize if chunk.device.type == "cpu" else 1

    @staticmethod
    def _run(chunk: Chunk, start: int, end: int, step: int) -> Run:
        """The :class:`Run` of ``chunk``'s pieces ``[start, end)``."""
        first, last = chunk.pieces[start], chunk.pieces[end - 1]
        lo, hi = chunk.offset_of(first), chunk.offset_of(last) + last.numel
        if chunk.exp_avg is None or chunk.exp_avg_sq is None:
            raise RuntimeError("internal error: a chunk has no moments at its update (bind() allocates them before a step)")
        if chunk.on_host:  # params copied back whole by the offload pipeline
            if chunk.master is None:
                raise RuntimeError("internal error: a chunk in host memory has no master of its own")
            param, grad, param_out = chunk.master[lo:hi], chunk.host_grad_buffer()[lo:hi], None
        else:
            param, grad = chunk.weights[lo:hi], chunk.grad[lo:hi]
            param_out = None if chunk.master is None else chunk.params[lo:hi]
        return Run(param, grad, chunk.exp_avg[lo:hi], chunk.exp_avg_sq[lo:hi], param_out, step)
