"""`python -m attnlib bench`: time and memory of naive, tiled and fused (SDPA) attention vs T.

Every method runs on the same q, k, v [1, H, T, D] in float32, causal with T = S. Times are
medians of interleaved repeats (method after method, so that a noisy neighbour slows all of
them alike), reported as ratios to SDPA and as a fraction of this machine's matmul rate.
Memory is the peak that PyTorch's allocator holds during one call (attnlib.memory).
"""

import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .attention import causal_attention
from .cost import attention_flops, score_matrix_bytes
from .memory import peak_allocated_bytes, peak_rss_bytes
from .tiled import tiled_attention

METHODS = ("naive", "tiled", "sdpa_mask", "sdpa_causal")
LABELS = {
    "naive": "causal_attention (naive)",
    "tiled": "tiled_attention",
    "sdpa_mask": "SDPA, explicit bottom-right mask",
    "sdpa_causal": "SDPA, is_causal=True",
}


def add_arguments(parser) -> None:
    """The command's options."""
    parser.add_argument("--sizes", type=int, nargs="+", help="sequence lengths T (= S)")
    parser.add_argument("--naive-max", type=int, help="largest T for the naive method")
    parser.add_argument("--heads", type=int, help="heads H (default 8)")
    parser.add_argument("--dim", type=int, help="head dimension D (default 64)")
    parser.add_argument("--repeats", type=int, help="timed calls per method and size")
    parser.add_argument("--block-size", type=int, default=256, help="tiled_attention's block")
    parser.add_argument("--out", default="artifacts/bench.json", help="JSON report path")
    parser.add_argument("--plot", default="artifacts/bench.png", help="PNG plot path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for tests")


def _settings(args) -> dict:
    quick = {"sizes": [64, 128, 256], "naive_max": 256, "heads": 2, "dim": 16, "repeats": 2}
    full = {"sizes": [512, 1024, 2048, 4096, 8192], "naive_max": 4096, "heads": 8, "dim": 64}
    defaults = quick if args.quick else {**full, "repeats": 5}
    chosen = {key: getattr(args, key) for key in defaults if getattr(args, key) is not None}
    settings = {**defaults, **chosen, "block_size": args.block_size, "seed": args.seed}
    for key in ("naive_max", "heads", "dim", "repeats", "block_size"):
        if settings[key] < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be at least 1, got {settings[key]}")
    if min(settings["sizes"]) < 1:
        raise ValueError(f"--sizes must be positive, got {settings['sizes']}")
    settings["sizes"] = sorted(set(settings["sizes"]))
    return settings


def matmul_roofline(quick: bool, repeats: int = 5) -> dict:
    """Best float32 matmul rate (GFLOP/s) over square products and attention-tile shapes."""
    shapes = [(1, n, n, n) for n in ((128, 256) if quick else (512, 1024, 2048))]
    shapes += [(8, 256, 64, 256), (8, 256, 256, 64)]  # [8, 256, 64] @ [8, 64, 256] and back
    best = {"gflops": 0.0}
    for batch, m, inner, n in shapes:
        a, b = torch.randn(batch, m, inner), torch.randn(batch, inner, n)
        torch.bmm(a, b)  # warm up
        seconds = min(_seconds(lambda a=a, b=b: torch.bmm(a, b)) for _ in range(repeats))
        rate = 2 * batch * m * inner * n / seconds / 1e9
        if rate > best["gflops"]:
            best = {"gflops": rate, "shape": f"[{batch}, {m}, {inner}] @ [{batch}, {inner}, {n}]"}
    return best


def _seconds(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _calls(q, k, v, mask, block_size) -> dict:
    return {
        "naive": lambda: causal_attention(q, k, v),
        "tiled": lambda: tiled_attention(q, k, v, block_size=block_size),
        "sdpa_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "sdpa_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }


def growth_exponent(sizes, values):
    """Least-squares slope of log(value) against log(T): value ~ T^slope. None if < 2 points."""
    if len(set(sizes)) < 2 or min(values) <= 0:
        return None
    xs, ys = [math.log(s) for s in sizes], [math.log(v) for v in values]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    num = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
    return num / sum((x - mean_x) ** 2 for x in xs)


def measure(settings: dict, progress=None) -> list:
    """Run every method at every size; return one row (a JSON-ready dict) per method and size."""
    heads, dim, repeats = settings["heads"], settings["dim"], settings["repeats"]
    rows = []
    for length in settings["sizes"]:
        gen = torch.Generator().manual_seed(settings["seed"] + length)
        q, k, v = (torch.randn(1, heads, length, dim, generator=gen) for _ in range(3))
        mask = torch.ones(length, length, dtype=torch.bool).tril()  # bottom-right, T = S
        calls = _calls(q, k, v, mask, settings["block_size"])
        if length > settings["naive_max"]:
            del calls["naive"]
        reference = calls["sdpa_causal"]()
        errors = {name: float((call() - reference).abs().max()) for name, call in calls.items()}
        times = {name: [] for name in calls}
        for _ in range(repeats):  # interleaved: each round times every method once
            for name, call in calls.items():
                times[name].append(_seconds(call))
                if progress is not None:
                    progress.update(1)
        for name, call in calls.items():
            rows.append(
                {
                    "method": name,
                    "T": length,
                    "median_s": statistics.median(times[name]),
                    "times_s": times[name],
                    "peak_bytes": peak_allocated_bytes(call),
                    "os_peak_bytes": peak_rss_bytes(call),  # cross-check, exact only when large
                    "max_abs_err_vs_sdpa": errors[name],
                }
            )
            if progress is not None:
                progress.update(1)
    return rows


def summarise(rows, settings: dict, roofline: dict) -> dict:
    """Add ratios, roofline fractions, growth exponents and the target checks to the rows."""
    heads, dim = settings["heads"], settings["dim"]
    by = {(r["method"], r["T"]): r for r in rows}
    for r in rows:
        useful = attention_flops(r["T"], r["T"], dim, heads=heads, causal=True)
        r["useful_gflop"] = useful / 1e9
        r["roofline_fraction"] = useful / r["median_s"] / 1e9 / roofline["gflops"]
        r["time_vs_sdpa_causal"] = r["median_s"] / by[("sdpa_causal", r["T"])]["median_s"]
        r["time_vs_sdpa_mask"] = r["median_s"] / by[("sdpa_mask", r["T"])]["median_s"]
        r["score_matrix_bytes"] = score_matrix_bytes(r["T"], r["T"], heads=heads)
        r["peak_vs_scores"] = r["peak_bytes"] / r["score_matrix_bytes"]
    exponents = {}
    for method in METHODS:
        mine = [r for r in rows if r["method"] == method]
        sizes = [r["T"] for r in mine]
        exponents[method] = {
            "time": growth_exponent(sizes, [r["median_s"] for r in mine]),
            "memory": growth_exponent(sizes, [r["peak_bytes"] for r in mine]),
            "sizes": sizes,
        }
    return {"exponents": exponents, "targets": _targets(by, exponents, settings)}


def _targets(by, exponents, settings) -> dict:
    """The closing note's three figures, each with its measured value and whether it is met."""
    sizes = settings["sizes"]
    targets = {}
    speed_at = 4096 if 4096 in sizes else max(sizes)
    ratio = by[("tiled", speed_at)]["time_vs_sdpa_causal"]
    targets["tiled_time_vs_sdpa"] = {
        "T": speed_at,
        "value": ratio,
        "target": "<= 2",
        "met": ratio <= 2,
    }
    memory_at = max(sizes)
    tiled_peak = by[("tiled", memory_at)]["peak_bytes"]
    naive = by.get(("naive", memory_at))
    if naive is not None:
        naive_peak, how = naive["peak_bytes"], "measured"
    else:  # extrapolate naive's power law from its largest measured size
        largest = max(t for (m, t) in by if m == "naive")
        slope = exponents["naive"]["memory"] or 2.0
        naive_peak = by[("naive", largest)]["peak_bytes"] * (memory_at / largest) ** slope
        how = f"extrapolated from T={largest} with exponent {slope:.2f}"
    share = tiled_peak / naive_peak
    targets["tiled_memory_vs_naive"] = {
        "T": memory_at, "value": share, "naive_peak_bytes": naive_peak, "naive_peak": how,
        "target": "<= 1/8", "met": share <= 1 / 8,
    }  # fmt: skip
    slope = exponents["naive"]["memory"]
    targets["naive_memory_exponent"] = {
        "value": slope,
        "target": "2 +- 0.2",
        "met": slope is not None and abs(slope - 2) <= 0.2,
    }
    return targets


def table(rows, summary) -> str:
    """The printed report: ratios, roofline fractions, memory; then exponents and targets."""
    lines = [
        f"{'T':>6}  {'method':<34}{'time/SDPA':>10}{'time/mask':>10}{'roofline':>9}"
        f"{'peak MiB':>10}{'OS MiB':>8}{'peak/scores':>12}{'max err':>9}"
    ]
    for r in sorted(rows, key=lambda r: (r["T"], METHODS.index(r["method"]))):
        lines.append(
            f"{r['T']:>6}  {LABELS[r['method']]:<34}{r['time_vs_sdpa_causal']:>10.2f}"
            f"{r['time_vs_sdpa_mask']:>10.2f}{r['roofline_fraction']:>9.0%}"
            f"{r['peak_bytes'] / 2**20:>10.1f}{r['os_peak_bytes'] / 2**20:>8.1f}"
            f"{r['peak_vs_scores']:>12.3f}"
            f"{r['max_abs_err_vs_sdpa']:>9.1e}"
        )
    lines += [
        "time/SDPA, time/mask: median time over SDPA's (is_causal=True; explicit mask)",
        "roofline: useful (visible-pair) FLOPs per second over the best matmul rate",
        "peak: PyTorch allocator's peak during one call; OS: rise of the resident high-water",
        "mark (it misses small blocks that reuse freed heap, so trust it for big ones)",
    ]
    lines.append("")
    lines.append("growth exponents (value ~ T^k, least squares on log-log):")
    for method, fit in summary["exponents"].items():
        if fit["time"] is not None:
            lines.append(
                f"  {LABELS[method]:<34} time k = {fit['time']:.2f}   memory k = "
                f"{fit['memory']:.2f}   (T = {', '.join(map(str, fit['sizes']))})"
            )
    lines.append("")
    lines.append("targets:")
    for name, target in summary["targets"].items():
        value = target["value"]
        shown = "n/a" if value is None else f"{value:.3g}"
        lines.append(
            f"  {name:<24} {shown:>8}  target {target['target']:<9} "
            f"{'met' if target['met'] else 'NOT met'}"
        )
    return "\n".join(lines)


def plot(rows, path: str) -> None:
    """Log-log plot of median time and peak memory against T, with a T^2 guide."""
    from .plots import plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10.0, 4.0))
    for method in METHODS:
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["T"])
        sizes = [r["T"] for r in mine]
        left.plot(sizes, [r["median_s"] for r in mine], "o-", label=LABELS[method])
        right.plot(sizes, [r["peak_bytes"] / 2**20 for r in mine], "o-", label=LABELS[method])
    naive = sorted((r for r in rows if r["method"] == "naive"), key=lambda r: r["T"])
    if naive:
        sizes = sorted({r["T"] for r in rows})
        base = naive[0]
        for ax, value in ((left, base["median_s"]), (right, base["peak_bytes"] / 2**20)):
            guide = [value * (s / base["T"]) ** 2 for s in sizes]
            ax.plot(sizes, guide, "k:", label="T^2 guide")
    left.set(xscale="log", yscale="log", xlabel="T (queries = keys)", ylabel="median time (s)")
    right.set(xscale="log", yscale="log", xlabel="T (queries = keys)", ylabel="peak extra MiB")
    sizes = sorted({r["T"] for r in rows})
    for ax in (left, right):
        ax.set_xticks(sizes, labels=[str(s) for s in sizes], minor=False)
        ax.set_xticks([], minor=True)  # no 3x10^3-style minor labels between the sizes
    left.set_title("time per call")
    right.set_title("peak memory per call")
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def run(args) -> int:
    """Measure, print the table, write the JSON report and the PNG plot."""
    from tqdm import tqdm

    settings = _settings(args)
    started, load_before = time.perf_counter(), os.getloadavg()
    roofline = matmul_roofline(args.quick)
    sizes = settings["sizes"]
    steps = sum((4 if t <= settings["naive_max"] else 3) * (settings["repeats"] + 1) for t in sizes)
    with tqdm(total=steps, desc="bench", unit="call") as progress:
        rows = measure(settings, progress)
    summary = summarise(rows, settings, roofline)
    report = {
        "settings": settings,
        "machine": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "roofline": roofline,
        "memory_method": (
            "peak of PyTorch CPU allocator events under torch.profiler (profile_memory=True), "
            "replayed in time order; os_peak_bytes is Linux's VmHWM rise, as a cross-check"
        ),
        "results": rows,
        **summary,
        "wall_s": time.perf_counter() - started,
    }
    print(f"matmul roofline: {roofline['gflops']:.1f} GFLOP/s ({roofline['shape']})")
    print(table(rows, summary))
    for path in (args.out, args.plot):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    plot(rows, args.plot)
    print(f"wrote {args.out} and {args.plot} in {report['wall_s']:.1f} s")
    return 0
