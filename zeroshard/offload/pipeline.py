"""``offload="cpu"`` (ZeRO-Offload, Ren et al., USENIX ATC 2021): the copies around the CPU update of a host chunk, gradient
device → host and updated params host → device (docs/offload.md, "One offloaded step"); the update is ``FusedAdam.step``'s."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from zeroshard.layout.chunk import Chunk

CPU_ADAM_RANGE = "zeroshard.offload.cpu_adam"  # torch.profiler range of each host chunk's CPU update


class OffloadPipeline:
    """The copies of one step's host chunks: gradients to the host, updated params back.

    Per step: :meth:`start` with the chunks that take the CPU update; then, chunk by chunk in layout order,
    :meth:`receive_grad` before the CPU update and :meth:`send_params` after it; finally :meth:`finish`. On CUDA the copies
    run on two streams of their own (created on first use, kept), overlapping the CPU update of the chunk between them; on
    a CPU-only machine (or in a step without host chunks) the same calls are plain copies, in order.
    """

    def __init__(self) -> None:
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None  # (device -> host, host -> device)
        self._arrived: dict[Chunk, torch.cuda.Event] = {}  # per host chunk: its gradient copy has landed
        self._compute: torch.cuda.Stream | None = None  # the stream the update and the all-gathers are queued on; None: no CUDA copies

    def start(self, chunks: list[Chunk]) -> None:
        """Queue every device → host gradient copy of ``chunks`` (the host chunks with used pieces).

        On CUDA all at once on the copy stream, one event per chunk, before the device chunks' kernels are launched, so the
        first host chunk can be updated without waiting for those kernels. Elsewhere nothing is queued: :meth:`receive_grad` copies.
        """
        self._arrived = {}
        self._compute = None
        if not chunks or chunks[0].params.device.type != "cuda":
            return
        device = chunks[0].params.device
        if self._streams is None:
            self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        d2h, h2d = self._streams
        self._compute = torch.cuda.current_stream(device)
        # Hand-off 1: the grad shards are complete (reduce-scatter, norm) once the compute stream
        # reaches this point, and the backward no longer reads the params: both copy streams
        # start from here (not after the device chunks' kernels, queued next on the compute stream).
        d2h.wait_stream(self._compute)
        h2d.wait_stream(self._compute)
        with torch.cuda.stream(d2h):
            for chunk in chunks:
                chunk.host_grad_buffer().copy_(chunk.grad, non_blocking=True)
                self._arrived[chunk] = torch.cuda.Event()
                self._arrived[chunk].record(d2h)

    def receive_grad(self, chunk: Chunk) -> None:
        """Return once ``chunk.host_grad`` holds the chunk's gradient (blocks the CPU on CUDA)."""
        if self._compute is None:
            chunk.host_grad_buffer().copy_(chunk.grad)
            return
        # Hand-off 2: the CPU reads the host copy of this chunk only once it has landed; the
        # copies of the following chunks continue meanwhile.
        self._arrived[chunk].synchronize()

    def send_params(self, chunk: Chunk) -> None:
        """Write ``chunk``'s updated host master into its slice of the flat param buffer, cast to the param dtype (on CUDA
        queued on the host → device stream, which the compute stream then waits for)."""
        master, target = chunk.master, chunk.params
        if master is None:
            raise RuntimeError("internal error: a chunk in host memory has no master of its own")
        if self._compute is None or self._streams is None:
            target.copy_(master)
            return
        source = master
        if master.dtype != target.dtype:  # cast on the host, into pinned memory, then one DMA copy
            source = chunk.host_param_buffer().copy_(master)
        h2d = self._streams[1]
        with torch.cuda.stream(h2d):
            # Hand-off 3: the source is written by the CPU above, before this copy is queued.
            target.copy_(source, non_blocking=True)
        # Hand-off 4: the bucket's all-gather, queued later on the compute stream by the
        # optimizer's step(), reads the params just copied: the compute stream waits for the copy.
        self._compute.wait_stream(h2d)

    def finish(self) -> None:
        """End the step's copies (after the last :meth:`send_params`)."""
        if self._compute is not None and self._streams is not None:
            # Hand-off 5: the next backward's reset writes the grad shards the gradient copies
            # read. The host buffers are next written after the next step's hand-off 2, which
            # follows all of this step's copies.
            self._compute.wait_stream(self._streams[0])
        self._arrived = {}
        self._compute = None
