"""Timing helpers shared by the kernel benchmarks: medians of repeated runs, device copy bandwidth."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int = 20, warmup: int = 3) -> float:
    """Median wall time of `fn()` in milliseconds, synchronising the device around each run."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs(device: torch.device, num_bytes: int = 1 << 30, repeats: int = 10) -> float:
    """Measured device-to-device copy bandwidth (bytes read per second, GB/s): the roofline for a streaming read."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, repeats=repeats)
    return num_bytes / (ms * 1e-3) / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
