"""The fused Adam/AdamW step on this rank's chunks, on the device or (offloaded) on the host.

See [Note: zeroshard buffers] in ``zeroshard/flat_buffer.py`` for chunks, masters and shards.

For ``torch.optim.Adam`` and ``AdamW`` without ``amsgrad``, ``capturable`` or ``differentiable``,
``exp_avg`` and ``exp_avg_sq`` live in one flat buffer per chunk (this rank's slice of one
bucket) in the master dtype (fp32; fp64 for fp64 params), and the wrapped optimizer's
``state[virtual_param]`` entries are views of them — so
``state_dict()``, checkpoints and LR schedulers see ordinary ``torch.optim`` state while the
update runs over whole runs of pieces. A run is a maximal sequence of adjacent pieces of one
chunk that got a gradient and share a step count.

A chunk is either on the device or, with ``offload="cpu"``, in host memory (master, moments and a
host copy of its gradient together). Device chunks take :func:`zeroshard.kernels.fused_adamw_` on
CUDA (16-bit params receive the cast of the updated master in the same pass) and torch's own
functional Adam/AdamW elsewhere (the ``foreach``/``fused`` implementation the user configured).
Host chunks take torch's fused CPU Adam/AdamW, chunk by chunk, with the copies pipelined around
it on CUDA streams (:meth:`FusedAdam._host_step`). ``gpu_margin_mem_ratio`` moves chunks from
the host to the device once, after the first iteration (:meth:`FusedAdam.place_on_device`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from torch import Tensor
from torch.optim.adam import adam as functional_adam
from torch.optim.adamw import adamw as functional_adamw

from zeroshard.kernels import fused_adamw_
from zeroshard.local_shard import LocalShard

Chunk = tuple[int, int]  # (shard index, bucket index)
CPU_ADAM_RANGE = "zeroshard.offload.cpu_adam"  # torch.profiler range of each host chunk's CPU update
Run = tuple[Tensor, Tensor, Tensor, Tensor, "Tensor | None", int]  # param, grad, exp_avg, exp_avg_sq, param_out, step


def fused_adam_kind(optimizer: torch.optim.Optimizer) -> str | None:
    """``"adamw"`` or ``"adam"`` when ``optimizer`` can take the fused path, else ``None``."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return None
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("capturable") or group.get("differentiable"):
            return None
        if isinstance(group["lr"], Tensor) or any(isinstance(b, Tensor) for b in group["betas"]):
            return None
    decoupled = type(optimizer) is torch.optim.AdamW or optimizer.defaults.get("decoupled_weight_decay", False)
    return "adamw" if decoupled else "adam"


def chunks_of(shards: list[LocalShard]) -> list[Chunk]:
    """Every chunk of ``shards`` in layout order (shard by shard, bucket by bucket): the same on every rank."""
    return [(k, b.index) for k, shard in enumerate(shards) for b in shard.buffer.layout.buckets]


def chunk_state_bytes(shard: LocalShard, bucket: int) -> int:
    """Device bytes chunk ``bucket`` of ``shard`` takes when kept on the device: its ``exp_avg``
    and ``exp_avg_sq`` in the master dtype and, for 16-bit params, its fp32 master."""
    numel = shard.buffer.layout.buckets[bucket].shard_numel(shard.buffer.layout.world_size)
    master = shard.master_dtype.itemsize if shard.master_dtype != shard.buffer.dtype else 0
    return numel * (2 * shard.master_dtype.itemsize + master)


class FusedAdam:
    """Flat moment buffers for every chunk, and the fused update over them.

    Args:
        optimizer: the wrapped ``torch.optim.Adam``/``AdamW``.
        kind: ``"adam"`` or ``"adamw"`` (see :func:`fused_adam_kind`).
        offload: chunks start in host memory (``offload="cpu"``) instead of on the device.

    Attributes:
        exp_avg, exp_avg_sq: per chunk, 1-D master dtype (fp32; fp64 for fp64 params), allocated
            on first use, on the chunk's side.
        host_grad: per host chunk, 1-D master dtype: the host copy of its gradient (pinned on CUDA).
        host_param: per host chunk of 16-bit params on CUDA, 1-D param dtype: pinned staging for
            the cast of the updated master on its way to the device.
        on_device: the chunks moved to the device by :meth:`place_on_device`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str, offload: bool = False) -> None:
        self.optimizer = optimizer
        self.adamw = kind == "adamw"
        self.offload = offload
        self.exp_avg: dict[Chunk, Tensor] = {}
        self.exp_avg_sq: dict[Chunk, Tensor] = {}
        self.host_grad: dict[Chunk, Tensor] = {}
        self.host_param: dict[Chunk, Tensor] = {}
        self.on_device: set[Chunk] = set()
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None  # (device->host, host->device)

    def on_host(self, chunk: Chunk) -> bool:
        """Whether ``chunk``'s master and moments are in host memory and it takes the CPU update."""
        return self.offload and chunk not in self.on_device

    def _bind(self, k: int, shard: LocalShard) -> None:
        """Allocate shard ``k``'s moment buffers; make every piece's state a view of them (copying loaded state in)."""
        for bucket in shard.buffer.layout.buckets:
            chunk = (k, bucket.index)
            if chunk not in self.exp_avg:
                home = torch.device("cpu") if self.on_host(chunk) else shard.grad_shard.device
                numel = bucket.shard_numel(shard.buffer.layout.world_size)
                self.exp_avg[chunk] = torch.zeros(numel, dtype=shard.master_dtype, device=home)
                self.exp_avg_sq[chunk] = torch.zeros(numel, dtype=shard.master_dtype, device=home)
        for piece, vparam in zip(shard.pieces, shard.virtual_params):
            state = self.optimizer.state.get(vparam)
            if not state:
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                view = self._state_view(key, k, shard, piece)
                if state[key].data_ptr() != view.data_ptr():  # fresh from load_state_dict
                    view.copy_(state[key].reshape(-1))
                    state[key] = view

    @torch.no_grad()
    def load(self, shards: list[LocalShard]) -> None:
        """Take the state the wrapped optimizer has just loaded: every moment buffer is zeroed and
        each loaded piece's state copied in, so pieces without loaded state start from zero, as
        in a freshly built optimizer (not from the moments they had before the load)."""
        for buffer in (*self.exp_avg.values(), *self.exp_avg_sq.values()):
            buffer.zero_()
        for k, shard in enumerate(shards):
            self._bind(k, shard)

    def _state_view(self, key: str, k: int, shard: LocalShard, piece) -> Tensor:
        bucket = shard.bucket_of(piece)
        start = piece.shard_offset - shard.buffer.layout.buckets[bucket].shard_offset
        flat = (self.exp_avg if key == "exp_avg" else self.exp_avg_sq)[(k, bucket)]
        return flat[start : start + piece.numel]

    @torch.no_grad()
    def place_on_device(self, shards: list[LocalShard], chunks: list[Chunk]) -> list[Chunk]:
        """Move ``chunks`` (master, moments) from host memory to the params' device, in order.

        Stops at the first chunk the device has no room for (``torch.cuda.OutOfMemoryError``),
        leaving it and the rest on the host, so placing never fails a step. Returns the chunks moved.
        """
        moved = []
        for shard in shards:
            shard.refresh_master()  # params loaded or written since the last step reach the masters first
        for k, b in chunks:
            shard = shards[k]
            self._bind(k, shard)
            device = shard.grad_shard.device
            try:
                shard.place_master(b, on_host=False)
                exp_avg, exp_avg_sq = self.exp_avg[(k, b)].to(device), self.exp_avg_sq[(k, b)].to(device)
            except torch.cuda.OutOfMemoryError:
                shard.place_master(b, on_host=True)  # back where it was, if it had moved
                break
            self.exp_avg[(k, b)], self.exp_avg_sq[(k, b)] = exp_avg, exp_avg_sq
            self.host_grad.pop((k, b), None)
            self.host_param.pop((k, b), None)
            self.on_device.add((k, b))
            moved.append((k, b))
            self._bind(k, shard)  # the state entries become views of the device buffers
        return moved

    @torch.no_grad()
    def step(self, shards: list[LocalShard], group_of_shard: list[int], steps: list[list[int]], multiplier: float,
             chunk_done: Callable[[int, int], None]) -> None:
        """Update every used piece of every shard; unused pieces and their state stay untouched.

        The host chunks' gradient copies are queued, then the device chunks' updates launched
        (on CUDA they run while the host works), then the host chunks take the pipelined CPU
        update; each bucket is handed to ``chunk_done`` as soon as it is final.

        Args:
            shards: this rank's shards.
            group_of_shard: for each shard, the index of its param group (hyperparameters).
            steps: per shard, per param: its step number after this update (the optimizer's
                replicated host count), or 0 when it got no gradient on any rank.
            multiplier: what the gradients are multiplied by (``1/loss_scale`` times the clip
                coefficient), folded into the update.
            chunk_done: called with (shard, bucket) for every chunk in layout order, once its
                params are final (see :func:`~zeroshard.step_path.apply_update`).
        """
        device_runs: dict[int, list[Run]] = defaultdict(list)  # per shard
        host_runs: dict[Chunk, list[Run]] = defaultdict(list)
        for k, shard in enumerate(shards):
            self._bind(k, shard)
            for start, end, step in self._runs(k, shard, steps[k]):
                chunk = (k, shard.bucket_of(shard.pieces[start]))
                if self.on_host(chunk):
                    host_runs[chunk].append(self._run_tensors(k, shard, start, end, step, self.host_grad_of(chunk, shard)))
                else:
                    device_runs[k].append(self._run_tensors(k, shard, start, end, step, shard.grad_shard))
        # The host chunks' gradient copies are queued before the device chunks' kernels, so the
        # first host chunk can be updated without waiting for those kernels.
        arrived = self._queue_grads_to_host(shards, host_runs) if host_runs else {}
        for k, runs in device_runs.items():
            self._device_step(runs, self.optimizer.param_groups[group_of_shard[k]], multiplier, shards[k].grad_shard.device)
        self._host_step(shards, group_of_shard, host_runs, multiplier, arrived, chunk_done)

    def _device_step(self, runs: list[Run], group: dict, multiplier: float, device: torch.device) -> None:
        grad_scale = None if multiplier == 1.0 else torch.full((1,), multiplier, device=device)
        if device.type == "cuda":
            for param, grad, exp_avg, exp_avg_sq, param_out, step in runs:
                fused_adamw_(
                    param, grad, exp_avg, exp_avg_sq, lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                    eps=group["eps"], weight_decay=group["weight_decay"], step=step, grad_scale=grad_scale,
                    param_out=param_out, maximize=group.get("maximize", False), adamw=self.adamw,
                )
            return
        if grad_scale is not None:
            for run in runs:
                run[1].mul_(grad_scale)
        self._functional(runs, group, foreach=group.get("foreach"), fused=group.get("fused"))
        for param, _, _, _, param_out, _ in runs:
            if param_out is not None:
                param_out.copy_(param)

    def _functional(self, runs: list[Run], group: dict, foreach: bool | None, fused: bool | None, grad_scale: Tensor | None = None) -> None:
        """torch's functional Adam/AdamW over ``runs``, one call per step count."""
        for step in sorted({run[-1] for run in runs}):
            batch = [run for run in runs if run[-1] == step]
            (functional_adamw if self.adamw else functional_adam)(
                [r[0] for r in batch], [r[1] for r in batch], [r[2] for r in batch], [r[3] for r in batch], [],
                [torch.tensor(float(step - 1)) for _ in batch],  # torch advances them to ``step``
                foreach=foreach, fused=fused, grad_scale=grad_scale, found_inf=None, amsgrad=False,
                beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"], weight_decay=group["weight_decay"],
                eps=group["eps"], maximize=group.get("maximize", False),
            )

    def _queue_grads_to_host(self, shards: list[LocalShard], host_runs: dict[Chunk, list[Run]]) -> dict[Chunk, torch.cuda.Event]:
        """On CUDA: queue every host chunk's device → host gradient copy on the copy stream; one event each.

        Returns the events (empty on a CPU-only machine, where :meth:`_host_step` copies in turn).
        """
        device = shards[0].grad_shard.device
        if device.type != "cuda":
            return {}
        if self._streams is None:
            self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        d2h, h2d = self._streams
        compute = torch.cuda.current_stream(device)
        # Hand-off 1: the grad shards are complete (reduce-scatter, norm) once the compute stream
        # reaches this point, and the backward no longer reads the params: both copy streams
        # start from here (not after the device chunks' kernels, queued next on the compute stream).
        d2h.wait_stream(compute)
        h2d.wait_stream(compute)
        arrived = {}
        with torch.cuda.stream(d2h):
            for k, b in host_runs:
                self.host_grad[(k, b)].copy_(shards[k].grad_slice(b), non_blocking=True)
                arrived[(k, b)] = torch.cuda.Event()
                arrived[(k, b)].record(d2h)
        return arrived

    def _host_step(self, shards: list[LocalShard], group_of_shard: list[int], host_runs: dict[Chunk, list[Run]], multiplier: float,
                   arrived: dict[Chunk, torch.cuda.Event], chunk_done: Callable[[int, int], None]) -> None:
        """The offloaded update: torch's fused CPU Adam/AdamW per host chunk, params host → device.

        Walks every chunk in layout order, calling ``chunk_done`` as each is final: device chunks
        (already launched) and unused ones at once, host chunks after their update. On CUDA the
        work is pipelined chunk by chunk on two copy streams (``arrived``: the gradient copies
        queued by :meth:`_queue_grads_to_host`), so that while the CPU updates chunk i, chunk
        i+1's gradient is on its way to the host and chunk i-1's params on their way back to the
        device and into their all-gather. On a CPU-only machine the same steps run in order, the
        copies being plain memcpys between separate buffers.
        """
        cuda = bool(arrived)
        compute = torch.cuda.current_stream(shards[0].grad_shard.device) if cuda else None
        # torch's fused kernel divides the gradients by grad_scale as it reads them: no extra pass.
        grad_scale = None if multiplier == 1.0 else torch.tensor(1.0 / multiplier)
        for k, b in chunks_of(shards):
            runs = host_runs.get((k, b))
            if runs is None:
                chunk_done(k, b)
                continue
            shard = shards[k]
            if cuda:
                # Hand-off 2: the CPU reads the host copy of chunk (k, b) only once it has landed;
                # the copies of the following chunks continue meanwhile.
                arrived[(k, b)].synchronize()
            else:
                self.host_grad[(k, b)].copy_(shard.grad_slice(b))
            with torch.profiler.record_function(CPU_ADAM_RANGE):
                self._functional(runs, self.optimizer.param_groups[group_of_shard[k]], foreach=None, fused=True, grad_scale=grad_scale)
            self._copy_params_to_device(k, b, shard, self._streams[1] if cuda else None)
            if cuda:
                # Hand-off 4: the bucket's all-gather, queued by chunk_done behind the compute
                # stream, reads the params just copied: the compute stream waits for the copy.
                compute.wait_stream(self._streams[1])
            chunk_done(k, b)
        if cuda:
            # Hand-off 5: the next backward's reset writes the grad shards the gradient copies
            # read. The host buffers are next written after the next step's hand-off 2, which
            # follows all of this step's copies.
            compute.wait_stream(self._streams[0])

    def _copy_params_to_device(self, k: int, b: int, shard: LocalShard, h2d: torch.cuda.Stream | None) -> None:
        """Write chunk (k, b)'s updated master into the flat param buffer, cast to the param dtype."""
        master, target = shard.master_slice(b), shard.buffer.slice_view(b, shard.rank)
        if h2d is None:
            target.copy_(master)
            return
        source = master
        if master.dtype != target.dtype:  # cast on the host, into pinned memory, then one DMA copy
            if (k, b) not in self.host_param:
                self.host_param[(k, b)] = torch.empty(master.numel(), dtype=target.dtype, pin_memory=True)
            source = self.host_param[(k, b)].copy_(master)
        with torch.cuda.stream(h2d):
            # Hand-off 3: the source is written by the CPU above, before this copy is queued.
            target.copy_(source, non_blocking=True)

    def host_grad_of(self, chunk: Chunk, shard: LocalShard) -> Tensor:
        """The host copy of ``chunk``'s gradient (allocated on first use)."""
        if chunk not in self.host_grad:
            numel = shard.grad_slice(chunk[1]).numel()
            pin = shard.grad_shard.device.type == "cuda"
            self.host_grad[chunk] = torch.empty(numel, dtype=shard.grad_shard.dtype, pin_memory=pin)
        return self.host_grad[chunk]

    def _run_tensors(self, k: int, shard: LocalShard, start: int, end: int, step: int, grads: Tensor) -> Run:
        """(param, grad, exp_avg, exp_avg_sq, param_out or None, step) views for pieces ``[start, end)``.

        ``grads``: the grad shard, or a host chunk's gradient copy (indexed from the chunk's start).
        """
        first, last = shard.pieces[start], shard.pieces[end - 1]
        bucket = shard.bucket_of(first)
        chunk_start = shard.buffer.layout.buckets[bucket].shard_offset
        lo, hi = first.shard_offset - chunk_start, last.shard_offset + last.numel - chunk_start
        flat = shard.buffer.data[first.flat_offset : first.flat_offset + hi - lo]
        master = shard.masters[bucket]
        param, param_out = (flat, None) if master is None else (master[lo:hi], flat)
        if self.on_host((k, bucket)):
            param_out = None  # copied back chunk by chunk by _copy_params_to_device
        else:
            grads = grads[chunk_start:]
        return param, grads[lo:hi], self.exp_avg[(k, bucket)][lo:hi], self.exp_avg_sq[(k, bucket)][lo:hi], param_out, step

    def _runs(self, k: int, shard: LocalShard, steps: list[int]):
        """(first piece, end piece, step) of each run; records the new step of every used piece.

        Steps come from the host counts in ``steps``, never from reading ``state["step"]`` (which
        torch may keep on the device): no host-device synchronization per piece.
        """
        run_start, run_step, run_bucket = None, None, None
        for i, (piece, vparam) in enumerate(zip(shard.pieces, shard.virtual_params)):
            step = steps[piece.param]
            if not step:
                if run_start is not None:
                    yield run_start, i, run_step
                run_start = None
                continue
            state = self.optimizer.state[vparam]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = self._state_view("exp_avg", k, shard, piece)
                state["exp_avg_sq"] = self._state_view("exp_avg_sq", k, shard, piece)
            state["step"].fill_(float(step))
            bucket = shard.bucket_of(piece)
            adjacent = run_start is not None and shard.pieces[i - 1].shard_offset + shard.pieces[i - 1].numel == piece.shard_offset
            if run_start is not None and (step != run_step or bucket != run_bucket or not adjacent):
                yield run_start, i, run_step
                run_start = None
            if run_start is None:
                run_start, run_step, run_bucket = i, step, bucket
        if run_start is not None:
            yield run_start, len(shard.pieces), run_step

    def state_tensors(self) -> list[Tensor]:
        """The flat moment buffers (for memory accounting)."""
        return list(self.exp_avg.values()) + list(self.exp_avg_sq.values())

    def host_grad_tensors(self) -> list[Tensor]:
        """Offload: the host copies of the grad shards (for memory accounting)."""
        return list(self.host_grad.values())

    def staging_tensors(self) -> list[Tensor]:
        """Offload on CUDA with 16-bit params: the pinned param-dtype staging buffers (for memory accounting)."""
        return list(self.host_param.values())
