"""Wall-clock timing shared by the benchmark and the chapters: medians and the matmul rate."""

import math
import statistics
import time
from typing import Callable, Dict

import torch


def interleaved_medians(calls: Dict[str, Callable[[], object]], repeats: int = 5) -> dict:
    """Median seconds of each call, after one warm-up round, timed in rounds of one call each.

    Interleaving the calls means a noisy neighbour slows all of them alike.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    for call in calls.values():
        call()
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def median_seconds(call: Callable[[], object], repeats: int = 5) -> float:
    """Median wall-clock seconds of call() over `repeats` runs, after one warm-up run."""
    return interleaved_medians({"call": call}, repeats)["call"]


def matmul_rate(sizes=(512, 1024, 2048), repeats: int = 5) -> dict:
    """The machine's measured matmul rate: the best float32 GFLOP/s over square products and
    attention-tile shapes, the yardstick the chapters and the benchmark divide by.

    Returns {"gflops": rate, "shape": the product that reached it}; a NaN rate, which no other
    rate can beat, is kept, so that every claim divided by it fails.
    """
    shapes = [(1, n, n, n) for n in sizes] + [(8, 256, 64, 256), (8, 256, 256, 64)]
    best = {"gflops": 0.0, "shape": ""}
    for batch, rows, inner, cols in shapes:
        a, b = torch.randn(batch, rows, inner), torch.randn(batch, inner, cols)
        seconds = median_seconds(lambda a=a, b=b: torch.bmm(a, b), repeats)
        rate = 2 * batch * rows * inner * cols / seconds / 1e9
        if rate > best["gflops"] or math.isnan(rate):
            best = {
                "gflops": rate,
                "shape": f"[{batch}, {rows}, {inner}] @ [{batch}, {inner}, {cols}]",
            }
    return best
