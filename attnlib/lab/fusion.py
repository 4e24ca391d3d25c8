"""Chapter 15's fusion measurements: the passes the torch inner makes over one tile of scores,
against one compiled pass, and the whole forward with each inner (`tiled_attention(...,
inner="torch" | "cpp")`) against SDPA.

`python -m attnlib bench-fusion` (or `python -m attnlib.lab.fusion`) runs the benchmark
(interleaved medians) and writes its JSON.
"""

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import native
from ..tiled import LOG2_E, tiled_attention

# The four tensor operations of the torch inner that sweep a whole tile of scores: name, how
# many times each reads the tile and how many times it writes it.
TORCH_PASSES = (("amax", 1, 0), ("sub_", 1, 1), ("exp2_", 1, 1), ("sum", 1, 0))
MEASURED = Path(__file__).parent / "fusion_measured.json"  # written by main() on one machine


def tile_traffic(rows: int, width: int, dim: int, itemsize: int = 4) -> dict:
    """Bytes of one tile of [rows, width] scores and its work, for head size `dim`.

    "torch": the bytes the torch inner moves through the tile where it does not fit the cache:
    the first matmul writes it, each of the four sweeps reads it (and two write it), the second
    matmul reads it. "fused": the compiled forward keeps the tile in the cache from the first
    matmul to the last, so what it moves is the [width, dim] blocks of K and V. "flops": the
    two matmuls, 2 * rows * width * dim each.
    """
    tile = rows * width * itemsize
    sweeps = sum(reads + writes for _, reads, writes in TORCH_PASSES)
    return {"tile": tile, "torch": (2 + sweeps) * tile, "fused": 2 * width * dim * itemsize,
            "flops": 4 * rows * width * dim}  # fmt: skip


def levels_between(caches, kept: int, swept: int) -> list:
    """The cache levels past which eq. 15.1's byte counts hold: those that hold the compiled
    forward's tile of `kept` bytes but not the torch inner's tile of `swept` bytes.

    caches: [(level, type, bytes)] as `traffic.cache_sizes()` lists them; data and unified caches
    only. A cache of exactly `swept` bytes counts as too small, since the tile is not all it holds.
    """
    if not 0 < kept < swept:
        raise ValueError(f"kept ({kept}) must be positive and below swept ({swept})")
    return [
        (level, kind, size)
        for level, kind, size in caches
        if kind.lower() in ("data", "unified") and kept < size <= swept
    ]


def tile_gain(seconds: dict) -> float:
    """The torch inner's four sweeps' time over the compiled pass's, on one tile (the gain of
    fusing the softmax steps), from `tile_step_seconds`' medians or a report's "tile" entry."""
    return sum(seconds[name] for name, _, _ in TORCH_PASSES) / seconds["fused"]


def _fused_step(kernel, scores, m, ell):
    """One tile's softmax steps (eq. 14.1) by the compiled pass, in place: m <- m', l <- l', the
    scores <- 2^(s - m'); returns the rescale factors 2^(m - m')."""
    rescale = torch.empty_like(m)
    pointers = (x.data_ptr() for x in (scores, m, ell, rescale))
    kernel(*pointers, m.numel(), scores.shape[-1], torch.get_num_threads())
    return rescale


def _torch_passes(scores, m, ell) -> dict:
    """The torch inner's steps on one tile, each sweep timed alone: name -> seconds."""
    clock, seconds = time.perf_counter, {}
    start = clock()
    top = scores.amax(-1, keepdim=True)
    seconds["amax"], start = clock() - start, clock()
    new_m = torch.maximum(m, top)
    scores.sub_(new_m)
    seconds["sub_"], start = clock() - start, clock()
    scores.exp2_()
    seconds["exp2_"], start = clock() - start, clock()
    ell.mul_(torch.exp2(m - new_m)).add_(scores.sum(-1, keepdim=True))
    seconds["sum"] = clock() - start
    return seconds


def tile_step_seconds(rows=2048, width=256, repeats=21, seed=0) -> dict:
    """Median seconds of one tile's softmax steps: each of the torch inner's four sweeps, and
    the compiled pass doing all of them, interleaved, on the same seeded scores (base 2)."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(1, 1, rows, width, generator=gen) * 3 * LOG2_E
    kernel, times = native.tile_kernels("tile_pass")[0], {name: [] for name, _, _ in TORCH_PASSES}
    times["fused"] = []
    for _ in range(repeats):
        for inner in ("torch", "fused"):
            s, m = scores.clone(), torch.full((1, 1, rows, 1), torch.finfo(torch.float32).min)
            ell = torch.zeros(1, 1, rows, 1)
            if inner == "torch":
                for name, took in _torch_passes(s, m, ell).items():
                    times[name].append(took)
            else:
                start = time.perf_counter()
                _fused_step(kernel, s, m, ell)
                times["fused"].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def forward_seconds(length, heads=8, dim=64, repeats=5, window=None, seed=0, train=False):
    """Median seconds of SDPA and of tiled_attention with each inner, interleaved, causal: of
    the forward, or with train=True of a training step (forward, then dQ, dK, dV for a seeded
    dO)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, grad = (torch.randn(1, heads, length, dim, generator=gen) for _ in range(4))
    positions = torch.arange(length)
    allowed = None if window is None else positions[:, None] - positions[None, :] < window
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    mask = None if allowed is None else mask & allowed
    methods = {
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=mask is None, attn_mask=mask
        ),
        "torch": lambda q, k, v: tiled_attention(q, k, v, allowed=allowed),
        "cpp": lambda q, k, v: tiled_attention(q, k, v, allowed=allowed, inner="cpp"),
    }

    def call(attention):
        if not train:
            return attention(q, k, v)
        inputs = [x.detach().requires_grad_() for x in (q, k, v)]
        return torch.autograd.grad(attention(*inputs), inputs, grad)

    times = {name: [] for name in methods}
    for attention in methods.values():
        call(attention)  # warm up: first-call costs, the library's build
    for _ in range(repeats):
        for name, attention in methods.items():
            start = time.perf_counter()
            call(attention)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


@contextmanager
def busy_core():
    """A second process spinning on a core for as long as the block runs."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        yield
    finally:
        spinner.kill()
        spinner.wait()


def measure(lengths=(1024, 2048, 4096, 8192, 16384), repeats=5) -> dict:
    """The benchmark: both inners against SDPA at each length; at one length, with a window,
    under load, and a training step."""
    rows = []
    for length in lengths:
        seconds = forward_seconds(length, repeats=repeats if length < 16384 else 3)
        rows.append({"T": length, **seconds})
        print(f"T = {length:>6}: " + ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in seconds.items()))
    probe = 4096 if 4096 in lengths else max(lengths)  # the length of the two side findings
    window = {"T": probe, "window": 256, **forward_seconds(probe, repeats=repeats, window=256)}
    with busy_core():
        loaded = {"T": probe, **forward_seconds(probe, repeats=repeats)}
    train = {"T": probe, **forward_seconds(probe, repeats=repeats, train=True)}
    machine = {
        "processor": _processor(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    return {"machine": machine, "rows": rows, "window": window, "loaded": loaded,
            "train": train, "tile": tile_step_seconds()}  # fmt: skip


def _processor() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def arguments(parser) -> None:
    """The options of the benchmark (`python -m attnlib bench-fusion`)."""
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(MEASURED))


def run(args) -> int:
    """Measure, print each length's times and ratios to SDPA, write the JSON report."""
    if min(args.lengths) < 1 or args.repeats < 1:
        print("error: --lengths and --repeats must be positive", file=sys.stderr)
        return 2
    started = time.perf_counter()
    native.tile_kernels("tiled_forward")
    report = {"build_or_load_s": time.perf_counter() - started}
    report.update(measure(args.lengths, args.repeats))
    report["wall_s"] = time.perf_counter() - started
    for name, row in [("forward", row) for row in report["rows"]] + [("train", report["train"])]:
        print(f"{name} T = {row['T']:>6}: torch {row['torch'] / row['sdpa']:.2f}x SDPA, "
              f"cpp {row['cpp'] / row['sdpa']:.2f}x SDPA")  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out} in {report['wall_s']:.0f} s")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnlib.lab.fusion", description=__doc__)
    arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
