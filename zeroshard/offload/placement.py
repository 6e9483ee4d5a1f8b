"""``gpu_margin_mem_ratio``: the measured GPU margin, and which offloaded chunks move into it, as PatrickStar (Fang et al.,
2021, §5) and ColossalAI's ``ShardedOptimizerV2`` do (docs/offload.md, "gpu_margin_mem_ratio"): :class:`MemoryTracer` over the
first iteration, :func:`measure_margin`, then :func:`plan_placement`, both run by :func:`place_chunks`, whose :class:`Placement`
the optimizer keeps as ``opt.placement``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

import psutil
import torch

from zeroshard.layout.chunk import Chunk

FRAGMENTATION_HEADROOM = 0.05  # fraction of the device capacity left free for the allocator's fragmentation
MIB = 2**20


class MemoryTracer:
    """Baseline and peak memory, on the device and on the host, between ``start()`` and ``stop()`` (or over a ``with`` block).

    Follows the runtime memory tracer of PatrickStar (Fang et al., "PatrickStar", 2021, §4) and ColossalAI's
    ``MemStatsCollector``: the peak during a training iteration minus the model data is the peak *non-model* memory
    (activations and temporaries), what an offloading optimizer must leave free. On CUDA the device figures come from the
    caching allocator (``max_memory_allocated`` after ``reset_peak_memory_stats``) and the capacity from ``mem_get_info``;
    host figures (and the device figures on a CPU-only machine, where the device is the host) from the process's RSS
    (``psutil``), sampled by a background thread every ``sample_interval_s`` seconds.

    Args:
        device: the device to trace; default the current CUDA device if any, else the CPU.
        sample_interval_s: seconds between RSS samples (> 0).

    Attributes (bytes, set by ``stop()``):
        device_baseline_bytes, device_peak_bytes: allocated on entry, and the most at any point.
        device_capacity_bytes: the device's total memory (the machine's for the CPU).
        device_available_bytes: what this process could hold on the device on exit: CUDA's free memory plus what torch's
            caching allocator has reserved; on the CPU, the available memory plus the process's RSS.
        host_baseline_bytes, host_peak_bytes: the process's RSS on entry, and the most sampled.

    Raises:
        ValueError: ``sample_interval_s`` not positive.
    """

    def __init__(self, device: torch.device | str | None = None, sample_interval_s: float = 0.001) -> None:
        if not sample_interval_s > 0:
            raise ValueError(f"sample_interval_s={sample_interval_s!r} must be positive")
        default = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.device = torch.device(device) if device is not None else default
        self.sample_interval_s = sample_interval_s
        self.device_baseline_bytes = self.device_peak_bytes = self.device_capacity_bytes = self.device_available_bytes = 0
        self.host_baseline_bytes = self.host_peak_bytes = 0
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.host_peak_bytes = max(self.host_peak_bytes, self._process.memory_info().rss)
            self._stop.wait(self.sample_interval_s)

    def start(self) -> MemoryTracer:
        """Take the baseline figures and start the RSS sampler; returns ``self``."""
        self.host_baseline_bytes = self.host_peak_bytes = self._process.memory_info().rss
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.device_baseline_bytes = torch.cuda.memory_allocated(self.device)
        self._stop.clear()
        self._sampler = threading.Thread(target=self._sample, name="zeroshard-memory-tracer", daemon=True)
        self._sampler.start()
        return self

    def cancel(self) -> None:
        """Stop the RSS sampler without taking the final figures (idempotent)."""
        self._stop.set()

    def stop(self) -> None:
        """Stop the sampler and take the final figures (the attributes above).

        Raises:
            RuntimeError: :meth:`start` was not called.
        """
        if self._sampler is None:
            raise RuntimeError("MemoryTracer.stop() before start()")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._stop.set()
        self._sampler.join()
        self.host_peak_bytes = max(self.host_peak_bytes, self._process.memory_info().rss)
        if self.device.type == "cuda":
            self.device_peak_bytes = torch.cuda.max_memory_allocated(self.device)
            free, self.device_capacity_bytes = torch.cuda.mem_get_info(self.device)
            self.device_available_bytes = free + torch.cuda.memory_reserved(self.device)
        else:
            self.device_baseline_bytes, self.device_peak_bytes = self.host_baseline_bytes, self.host_peak_bytes
            memory = psutil.virtual_memory()
            self.device_capacity_bytes = memory.total
            self.device_available_bytes = memory.available + self._process.memory_info().rss

    def __enter__(self) -> MemoryTracer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def non_model_peak_bytes(self, model_data_bytes: int) -> int:
        """Peak device memory not taken by model data (params, gradients and optimizer state on the device, e.g.
        ``ShardedOptimizer.memory_usage().device_bytes``): ``device_peak_bytes - model_data_bytes`` (>= 0)."""
        return max(0, self.device_peak_bytes - model_data_bytes)

    def summary(self, model_data_bytes: int | None = None) -> str:
        """One readable line: device peak over capacity (and the non-model part), host peak."""
        line = (f"{self.device}: peak {self.device_peak_bytes / MIB:,.1f} MiB of {self.device_capacity_bytes / MIB:,.0f} MiB "
                f"(+{(self.device_peak_bytes - self.device_baseline_bytes) / MIB:,.1f} MiB over the start)")
        if model_data_bytes is not None:
            line += f", non-model peak {self.non_model_peak_bytes(model_data_bytes) / MIB:,.1f} MiB"
        if self.device.type == "cuda":
            line += f"; host RSS peak {self.host_peak_bytes / MIB:,.1f} MiB"
        return line


@dataclass(frozen=True)
class MarginMeasurement:
    """What the first iteration left free on the device (bytes)."""

    capacity_bytes: int  # what this process can use on the device (CUDA: free + reserved by torch's allocator; CPU-only: available + RSS)
    non_model_peak_bytes: int  # peak memory not taken by model data (activations, temporaries)
    model_data_bytes: int  # params, gradient buffers, grad shards, masters and state on the device
    headroom_bytes: int  # left free for fragmentation

    @property
    def margin_bytes(self) -> int:
        """``capacity − non-model peak − model data − headroom``, at least 0."""
        return max(0, self.capacity_bytes - self.non_model_peak_bytes - self.model_data_bytes - self.headroom_bytes)


@dataclass(frozen=True)
class Placement:
    """Where ``gpu_margin_mem_ratio`` put this rank's chunks, once, at the first ``step()``.

    Per-chunk fields list the chunks in layout order: the optimizer's flat buffers (param group by param group, dtype by
    dtype) and, in each, bucket by bucket. Sizes are bytes.
    """

    ratio: float  # the gpu_margin_mem_ratio (0.0 to 1.0) the plan was made with
    measurement: MarginMeasurement  # the first iteration's margin and its terms
    chunk_bytes: tuple[int, ...]  # device bytes of each chunk's state there (chunk_device_bytes: 12 per element for 16-bit params, 8 for fp32)
    planned: tuple[bool, ...]  # whether the plan put the chunk on the device (first fit within ratio × measurement.margin_bytes)
    # Whether the chunk is on the device now: the planned ones, unless the device ran out of memory while they moved (that
    # chunk and those after it stay in host memory).
    on_device: tuple[bool, ...]
    device: torch.device  # the params' device

    @property
    def device_bytes(self) -> int:
        """Bytes of the chunks on the device."""
        return sum(size for size, here in zip(self.chunk_bytes, self.on_device) if here)

    @property
    def host_bytes(self) -> int:
        """Bytes of the chunks in host memory."""
        return sum(self.chunk_bytes) - self.device_bytes

    @property
    def ran_out_of_memory(self) -> bool:
        """Whether some planned chunk stayed in host memory because the device had no room for it."""
        return self.on_device != self.planned

    def summary(self) -> str:
        """One line: the margin's terms, and the chunks (count, MiB) on each side (what rank 0 logs)."""
        m = self.measurement
        line = (
            f"zeroshard: gpu_margin_mem_ratio={self.ratio} of a {m.margin_bytes / MIB:,.0f} MiB margin "
            f"(capacity {m.capacity_bytes / MIB:,.0f} - non-model peak {m.non_model_peak_bytes / MIB:,.0f} "
            f"- model data {m.model_data_bytes / MIB:,.0f} - headroom {m.headroom_bytes / MIB:,.0f} MiB): "
            f"{sum(self.on_device)} of {len(self.chunk_bytes)} chunks ({self.device_bytes / MIB:,.1f} MiB of optimizer state) on {self.device}, "
            f"{len(self.chunk_bytes) - sum(self.on_device)} ({self.host_bytes / MIB:,.1f} MiB) in host memory"
        )
        if self.ran_out_of_memory:
            line += f" (the device ran out of memory after {sum(self.on_device)} of the {sum(self.planned)} planned)"
        return line


def measure_margin(tracer: MemoryTracer, model_data_bytes: int, headroom: float = FRAGMENTATION_HEADROOM) -> MarginMeasurement:
    """The margin from a finished ``tracer`` and the model data on the device now (bytes)."""
    capacity = tracer.device_available_bytes
    return MarginMeasurement(capacity, tracer.non_model_peak_bytes(model_data_bytes), model_data_bytes, int(headroom * capacity))


def chunk_device_bytes(chunk: Chunk) -> int:
    """Device bytes ``chunk`` takes when kept on the device: its ``exp_avg`` and ``exp_avg_sq`` in the master dtype and, for
    16-bit params, its fp32 master (fp32 params' flat param buffer is their master)."""
    master = chunk.master_dtype.itemsize if chunk.master_dtype != chunk.params.dtype else 0
    return chunk.numel * (2 * chunk.master_dtype.itemsize + master)


def plan_placement(chunk_bytes: Sequence[int], margin_bytes: int, ratio: float) -> list[bool]:
    """Which chunks stay on the device: first fit, in order, within ``ratio × margin_bytes``.

    Args:
        chunk_bytes: device bytes each chunk would take there (see :func:`chunk_device_bytes`).
        margin_bytes: the measured margin (:attr:`MarginMeasurement.margin_bytes`).
        ratio: ``gpu_margin_mem_ratio``, 0.0 (everything on the host) to 1.0 (the whole margin).

    Returns:
        One flag per chunk, ``True`` for the device. A chunk larger than what is left of the budget stays on the host (a
        later, smaller one may still fit); the chosen chunks never sum to more than ``ratio × margin_bytes``.

    Raises:
        ValueError: ``ratio`` outside [0, 1] or a negative size.
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"gpu_margin_mem_ratio={ratio!r} must be between 0.0 and 1.0")
    if margin_bytes < 0 or any(size < 0 for size in chunk_bytes):
        raise ValueError(f"plan_placement: sizes must be >= 0, got margin {margin_bytes} and chunks {list(chunk_bytes)[:8]}")
    budget = int(ratio * margin_bytes)
    plan = []
    for size in chunk_bytes:
        fits = size <= budget
        budget -= size if fits else 0
        plan.append(fits)
    return plan


def place_chunks(chunks: Sequence[Chunk], tracer: MemoryTracer, model_data_bytes: int, ratio: float, device: torch.device) -> Placement:
    """Measure the margin, plan, and move the planned ``chunks`` (layout order) to the device.

    Args:
        chunks: every chunk of the optimizer, in layout order, all in host memory, their masters current and their moments
            allocated (they move as they are).
        tracer: the first iteration's tracer, stopped.
        model_data_bytes: the optimizer's device bytes now (``memory_usage().device_bytes``).
        ratio, device: ``gpu_margin_mem_ratio`` and the params' device.

    Returns:
        The :class:`Placement`. Moving stops at the first chunk the device has no room for (``torch.cuda.OutOfMemoryError``),
        leaving it and the rest in host memory: placing never fails a step.
    """
    measurement = measure_margin(tracer, model_data_bytes)
    sizes = tuple(chunk_device_bytes(chunk) for chunk in chunks)
    plan = tuple(plan_placement(sizes, measurement.margin_bytes, ratio))
    for chunk, keep in zip(chunks, plan):
        if keep:
            try:
                chunk.move_to_device()
            except torch.cuda.OutOfMemoryError:
                break
    return Placement(ratio, measurement, sizes, plan, tuple(not chunk.on_host for chunk in chunks), device)
