"""The roofline of this machine (eq. 10.3): its two ceilings, measured, and what they allow.

A kernel that does I FLOPs per byte it moves can run no faster than min(peak, I * bandwidth):
the matmul rate caps arithmetic, the memory bandwidth caps everything that waits for bytes
(Williams, Waterman and Patterson 2009). Both ceilings assume every byte comes from memory; the
CPU's caches (last_level_cache_bytes) serve data small enough to stay, which cold_seconds
separates from a step that reads its data from memory.
"""

import math
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, Optional

import torch

from .timing import median_seconds

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def read_bandwidth(*tensors: torch.Tensor, repeats: int = 5) -> float:
    """Measured GB/s of reading `tensors` once each (a sum over every element), median of runs:
    the bandwidth of eq. 10.3.

    Summing reads each byte once and does one addition per number, far below the matmul rate,
    so the time is the time to fetch the bytes. Pass tensors at least as large as the data whose
    speed you want to bound: smaller ones may be served from the CPU's caches.
    """
    if not tensors:
        raise ValueError("read_bandwidth needs at least one tensor to read")
    nbytes = sum(t.nbytes for t in tensors)
    if nbytes == 0:
        raise ValueError("read_bandwidth needs tensors with at least one element")
    seconds = median_seconds(lambda: [t.sum() for t in tensors], repeats)
    return nbytes / seconds / 1e9


def attainable(intensity: float, peak_gflops: float, bandwidth_gbs: float) -> float:
    """The roofline, eq. 10.3: min(peak, intensity * bandwidth) GFLOP/s at I FLOPs per byte."""
    if intensity <= 0 or peak_gflops <= 0 or bandwidth_gbs <= 0:
        raise ValueError("intensity, peak and bandwidth must be positive")
    return min(peak_gflops, intensity * bandwidth_gbs)


def ridge(peak_gflops: float, bandwidth_gbs: float) -> float:
    """The intensity (FLOPs per byte) where the two ceilings of eq. 10.3 meet: peak / bandwidth."""
    if peak_gflops <= 0 or bandwidth_gbs <= 0:
        raise ValueError("peak and bandwidth must be positive")
    return peak_gflops / bandwidth_gbs


def last_level_cache_bytes(cpu: str = "/sys/devices/system/cpu/cpu0") -> Optional[int]:
    """Bytes of the CPU's largest data cache (its last level), as Linux lists it; None elsewhere.

    Data that fits in it can be read again without going out to memory, so it bounds the
    tensors read_bandwidth should be given, and it is where eq. 10.2's count of bytes, each read
    once from memory, stops describing small working sets.
    """
    levels = []
    for index in sorted(Path(cpu, "cache").glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified") and size[:-1].isdigit() and size[-1] in _UNITS:
            levels.append((level, int(size[:-1]) * _UNITS[size[-1]]))
        elif kind in ("Data", "Unified") and size.isdigit():
            levels.append((level, int(size)))
    return sorted(levels)[-1][1] if levels else None  # the highest level


def cold_seconds(call: Callable[[], object], *evict: torch.Tensor, repeats: int = 5) -> float:
    """Median seconds of call() right after summing `evict`, whose bytes push the call's data out
    of the CPU's caches (pass more than last_level_cache_bytes()): every byte the call reads
    then comes from memory, as eq. 10.2 counts it. Compare median_seconds(call), where a call
    repeated at once may find its data still cached."""
    if not evict or repeats < 1:
        raise ValueError("cold_seconds needs tensors to evict the caches with, and repeats >= 1")
    call()  # warm-up: allocations and dispatch, as median_seconds does
    seconds = []
    for _ in range(repeats):
        for tensor in evict:
            tensor.sum()
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def interleaved_fastest(calls: Dict[str, Callable[[], object]], repeats: int = 7) -> dict:
    """Seconds of each call's fastest run, after one warm-up round, timed in interleaved rounds.

    Other programs sharing the machine can only add time to a run, so the fastest run is the one
    they disturbed least; it is also the one to hold against eq. 10.3, whose ceilings bound the
    speed from above. Interleaving lets a slow spell of the machine fall on every call alike.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    for call in calls.values():
        call()
    fastest = {name: math.inf for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            seconds = time.perf_counter() - start
            if seconds < fastest[name]:  # a time is never NaN
                fastest[name] = seconds
    return fastest
