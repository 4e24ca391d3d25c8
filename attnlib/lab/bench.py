"""The benchmark behind `python -m attnlib bench`: time and memory of attention against T.

Every method runs on the same q, k, v [1, H, T, D] in float32, causal with T = S. Times are
medians of interleaved rounds (attnlib.lab.timing), reported as ratios to SDPA and as a share of
this machine's matmul rate; memory is the allocator's peak during one call (attnlib.lab.memory).
It prints measurements only: what counts as good enough is for the tests and the chapters.
"""

import torch
import torch.nn.functional as F

from ..attention import causal_attention
from ..cost import attention_flops, growth_exponent, score_matrix_bytes
from ..tiled import tiled_attention
from .memory import peak_allocated_bytes, peak_rss_bytes
from .timing import interleaved_medians

LABELS = {
    "naive": "causal_attention (naive)",
    "tiled": "tiled_attention",
    "sdpa_mask": "SDPA, explicit bottom-right mask",
    "sdpa_causal": "SDPA, is_causal=True",
}
QUICK = {"sizes": [64, 128, 256], "naive_max": 256, "heads": 2, "dim": 16, "repeats": 2}
FULL = {"sizes": [512, 1024, 2048, 4096, 8192], "naive_max": 4096, "heads": 8, "dim": 64}


def calls(q, k, v, block_size: int, naive: bool = True) -> dict:
    """The methods compared, each a no-argument call on the same q, k, v [1, H, T, D]."""
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()  # bottom-right, T = S
    methods = {
        "naive": lambda: causal_attention(q, k, v),
        "tiled": lambda: tiled_attention(q, k, v, block_size=block_size),
        "sdpa_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "sdpa_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    return methods if naive else {name: call for name, call in methods.items() if name != "naive"}


def measure_size(length: int, settings: dict) -> list:
    """One row (a JSON-ready dict) per method at T = S = length."""
    gen = torch.Generator().manual_seed(settings["seed"] + length)
    q, k, v = (
        torch.randn(1, settings["heads"], length, settings["dim"], generator=gen) for _ in "qkv"
    )
    methods = calls(q, k, v, settings["block_size"], naive=length <= settings["naive_max"])
    reference = methods["sdpa_causal"]()
    medians = interleaved_medians(methods, settings["repeats"])
    rows = []
    for name, call in methods.items():
        rows.append(
            {
                "method": name,
                "T": length,
                "median_s": medians[name],
                "peak_bytes": peak_allocated_bytes(call),
                "os_peak_bytes": peak_rss_bytes(call),  # a cross-check, exact only when large
                "max_abs_err_vs_sdpa": float((call() - reference).abs().max()),
            }
        )
    return rows


def summarise(rows: list, settings: dict, roofline: dict) -> dict:
    """Add ratios and roofline shares to each row; fit time and memory exponents per method."""
    by = {(r["method"], r["T"]): r for r in rows}
    for r in rows:
        useful = attention_flops(
            r["T"], r["T"], settings["dim"], heads=settings["heads"], causal=True
        )
        r["roofline_fraction"] = useful / r["median_s"] / 1e9 / roofline["gflops"]
        r["time_vs_sdpa_causal"] = r["median_s"] / by[("sdpa_causal", r["T"])]["median_s"]
        r["time_vs_sdpa_mask"] = r["median_s"] / by[("sdpa_mask", r["T"])]["median_s"]
        scores = score_matrix_bytes(r["T"], r["T"], heads=settings["heads"])
        r["peak_vs_scores"] = r["peak_bytes"] / scores
    exponents = {}
    for method in LABELS:
        mine = [r for r in rows if r["method"] == method]
        sizes = [r["T"] for r in mine]
        exponents[method] = {
            "time": growth_exponent(sizes, [r["median_s"] for r in mine]),
            "memory": growth_exponent(sizes, [r["peak_bytes"] for r in mine]),
            "sizes": sizes,
        }
    return exponents


def table(rows: list, exponents: dict) -> str:
    """The printed report: one line per method and size, then the growth exponents."""
    lines = [
        f"{'T':>6}  {'method':<34}{'time/SDPA':>10}{'time/mask':>10}{'roofline':>9}"
        f"{'peak MiB':>10}{'OS MiB':>8}{'peak/scores':>12}{'max err':>9}"
    ]
    for r in sorted(rows, key=lambda r: (r["T"], list(LABELS).index(r["method"]))):
        lines.append(
            f"{r['T']:>6}  {LABELS[r['method']]:<34}{r['time_vs_sdpa_causal']:>10.2f}"
            f"{r['time_vs_sdpa_mask']:>10.2f}{r['roofline_fraction']:>9.0%}"
            f"{r['peak_bytes'] / 2**20:>10.1f}{r['os_peak_bytes'] / 2**20:>8.1f}"
            f"{r['peak_vs_scores']:>12.3f}{r['max_abs_err_vs_sdpa']:>9.1e}"
        )
    lines += [
        "time/SDPA, time/mask: median time over SDPA's (is_causal=True; explicit mask)",
        "roofline: useful (visible-pair) FLOPs per second over the best matmul rate",
        "peak: the allocator's peak during one call; OS: rise of the resident high-water mark",
        "",
        "growth exponents (value ~ T^k, least squares on log-log):",
    ]
    for method, fit in exponents.items():
        if fit["time"] is not None:
            lines.append(
                f"  {LABELS[method]:<34} time k = {fit['time']:.2f}   memory k = "
                f"{fit['memory']:.2f}   (T = {', '.join(map(str, fit['sizes']))})"
            )
    return "\n".join(lines)


def plot(rows: list, path: str) -> None:
    """Log-log plot of median time and peak memory against T, one line per method."""
    from ..figures.plots import plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10.0, 4.0))
    sizes = sorted({r["T"] for r in rows})
    for method, label in LABELS.items():
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["T"])
        left.plot([r["T"] for r in mine], [r["median_s"] for r in mine], "o-", label=label)
        right.plot(
            [r["T"] for r in mine], [r["peak_bytes"] / 2**20 for r in mine], "o-", label=label
        )
    left.set(ylabel="median time (s)", title="time per call")
    right.set(ylabel="peak extra MiB", title="peak memory per call")
    for ax in (left, right):
        ax.set(xscale="log", yscale="log", xlabel="T (queries = keys)")
        ax.set_xticks(sizes, labels=[str(s) for s in sizes], minor=False)
        ax.set_xticks([], minor=True)  # no 3x10^3-style minor labels between the sizes
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
