"""``MemoryTracer``: peak device and host memory over a region of code, model data apart (docs/offload.md, "zeroshard.MemoryTracer")."""

from __future__ import annotations

import threading
from types import TracebackType

import psutil
import torch


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
        mib = 2**20
        line = (f"{self.device}: peak {self.device_peak_bytes / mib:,.1f} MiB of {self.device_capacity_bytes / mib:,.0f} MiB "
                f"(+{(self.device_peak_bytes - self.device_baseline_bytes) / mib:,.1f} MiB over the start)")
        if model_data_bytes is not None:
            line += f", non-model peak {self.non_model_peak_bytes(model_data_bytes) / mib:,.1f} MiB"
        if self.device.type == "cuda":
            line += f"; host RSS peak {self.host_peak_bytes / mib:,.1f} MiB"
        return line
