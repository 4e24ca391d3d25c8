"""The roofline of this machine (eq. 10.3): its two ceilings, measured, and what they allow.

A kernel that does I FLOPs per byte it moves can run no faster than min(peak, I * bandwidth):
the matmul rate caps arithmetic, the memory bandwidth caps everything that waits for bytes
(Williams, Waterman and Patterson 2009).
"""

import torch

from .timing import median_seconds


def read_bandwidth(*tensors: torch.Tensor, repeats: int = 5) -> float:
    """Measured GB/s of reading `tensors` once each (a sum over every element), median of runs.

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
    """The intensity (FLOPs per byte) where the two ceilings meet: peak / bandwidth."""
    if peak_gflops <= 0 or bandwidth_gbs <= 0:
        raise ValueError("peak and bandwidth must be positive")
    return peak_gflops / bandwidth_gbs
