"""The benchmark behind `python -m attnlib bench`: time and memory of attention against T.

Every method runs on the same q, k, v [1, H, T, D] in float32, causal with T = S. Times are
medians of interleaved rounds (attnlib.lab.timing), reported as ratios to SDPA and as a share of
this machine's matmul rate; memory is the allocator's peak during one call (attnlib.lab.memory).
Forward+backward rows time one training step (forward, then dQ, dK, dV for a random dO) with H
heads against SDPA's, and measure its peak memory with one head, against naive autograd's.
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
TRAINING_LABELS = {
    "naive_train": "causal_attention, autograd",
    "tiled_train": "tiled_attention",
    "sdpa_train": "SDPA, is_causal=True",
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


def training_calls(q, k, v, grad, block_size: int, naive: bool = True) -> dict:
    """One training step per method: a no-argument call returning (dQ, dK, dV) for dO = grad."""

    def step(attention):
        def call():
            inputs = [x.detach().requires_grad_() for x in (q, k, v)]
            return torch.autograd.grad(attention(*inputs), inputs, grad)

        return call

    methods = {
        "naive_train": step(causal_attention),
        "tiled_train": step(lambda q, k, v: tiled_attention(q, k, v, block_size=block_size)),
        "sdpa_train": step(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    }
    if not naive:
        del methods["naive_train"]
    return methods


def _inputs(length: int, settings: dict) -> list:
    """q, k, v and an upstream gradient dO, each [1, H, T, D], seeded by T."""
    gen = torch.Generator().manual_seed(settings["seed"] + length)
    return [
        torch.randn(1, settings["heads"], length, settings["dim"], generator=gen) for _ in "qkvo"
    ]


def _max_abs_error(tensors, references) -> float:
    """The largest |tensor - reference| over all pairs; NaN if any difference is NaN.

    torch's max keeps a NaN, where Python's max(0.0, nan) returns 0.0 and would hide it.
    """
    return float(torch.stack([(t - r).abs().max() for t, r in zip(tensors, references)]).max())


def forward_rows(length: int, settings: dict) -> list:
    """One row (a JSON-ready dict) per forward method at T = S = length."""
    q, k, v, _ = _inputs(length, settings)
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
                "max_abs_err_vs_sdpa": _max_abs_error([call()], [reference]),
            }
        )
    return rows


def training_rows(length: int, settings: dict) -> list:
    """One row per forward+backward method: time with H heads, peak memory with one head.

    Naive autograd is timed up to naive_max only, but its one-head memory is measured at every T.
    """
    q, k, v, grad = _inputs(length, settings)
    timed = training_calls(q, k, v, grad, settings["block_size"], length <= settings["naive_max"])
    reference = timed["sdpa_train"]()  # SDPA's dQ, dK, dV
    medians = interleaved_medians(timed, settings["repeats"])
    one_head = training_calls(*(x[:, :1] for x in (q, k, v, grad)), settings["block_size"])
    rows = []
    for name, call in one_head.items():
        grads = timed[name]() if name in timed else reference  # untimed: no error reported
        error = _max_abs_error(grads, reference)
        rows.append(
            {
                "method": name,
                "T": length,
                "median_s": medians.get(name),  # None where it was not timed
                "peak_bytes_one_head": peak_allocated_bytes(call),
                "max_abs_err_vs_sdpa": error if name in timed else None,
            }
        )
    return rows


def measure_size(length: int, settings: dict) -> list:
    """The forward rows, then the forward+backward rows, at T = S = length."""
    return forward_rows(length, settings) + training_rows(length, settings)


def summarise(rows: list, settings: dict, matmul: dict) -> dict:
    """Add ratios and shares of the measured matmul rate to each row; fit exponents per method."""
    by = {(r["method"], r["T"]): r for r in rows}
    for r in rows:
        if r["method"] in TRAINING_LABELS:
            sdpa, naive = by[("sdpa_train", r["T"])], by[("naive_train", r["T"])]
            timed = r["median_s"] is not None
            r["time_vs_sdpa_train"] = r["median_s"] / sdpa["median_s"] if timed else None
            r["peak_vs_naive"] = r["peak_bytes_one_head"] / naive["peak_bytes_one_head"]
            continue
        useful = attention_flops(
            r["T"], r["T"], settings["dim"], heads=settings["heads"], causal=True
        )
        r["matmul_fraction"] = useful / r["median_s"] / 1e9 / matmul["gflops"]
        r["time_vs_sdpa_causal"] = r["median_s"] / by[("sdpa_causal", r["T"])]["median_s"]
        r["time_vs_sdpa_mask"] = r["median_s"] / by[("sdpa_mask", r["T"])]["median_s"]
        scores = score_matrix_bytes(r["T"], r["T"], heads=settings["heads"])
        r["peak_vs_scores"] = r["peak_bytes"] / scores
    exponents = {}
    for method in {**LABELS, **TRAINING_LABELS}:
        timed = [r for r in rows if r["method"] == method and r["median_s"] is not None]
        mine = [r for r in rows if r["method"] == method]
        exponents[method] = {
            "time": growth_exponent([r["T"] for r in timed], [r["median_s"] for r in timed]),
            "memory": growth_exponent(
                [r["T"] for r in mine],
                [r.get("peak_bytes", r.get("peak_bytes_one_head")) for r in mine],
            ),
            "sizes": [r["T"] for r in mine],
            "time_sizes": [r["T"] for r in timed],
        }
    return exponents


def _training_lines(rows: list) -> list:
    """The forward+backward section of the table."""
    lines = [
        "",
        "forward + backward (time: one training step with H heads; memory: with one head):",
        f"{'T':>6}  {'method':<34}{'time/SDPA':>10}{'MiB, 1 head':>12}{'/naive':>8}{'max err':>9}",
    ]
    mine = [r for r in rows if r["method"] in TRAINING_LABELS]
    for r in sorted(mine, key=lambda r: (r["T"], list(TRAINING_LABELS).index(r["method"]))):
        timed = r["median_s"] is not None
        ratio = f"{r['time_vs_sdpa_train']:>10.2f}" if timed else f"{'-':>10}"
        error = f"{r['max_abs_err_vs_sdpa']:>9.1e}" if timed else f"{'-':>9}"
        lines.append(
            f"{r['T']:>6}  {TRAINING_LABELS[r['method']]:<34}{ratio}"
            f"{r['peak_bytes_one_head'] / 2**20:>12.1f}{r['peak_vs_naive']:>8.3f}{error}"
        )
    lines.append(
        "time/SDPA: over SDPA's step; /naive: peak over naive autograd's; max err: dQ, dK, dV"
    )
    return lines


def table(rows: list, exponents: dict) -> str:
    """The printed report: one line per method and size, then the growth exponents."""
    lines = [
        f"{'T':>6}  {'method':<34}{'time/SDPA':>10}{'time/mask':>10}{'of matmul':>10}"
        f"{'peak MiB':>10}{'OS MiB':>8}{'peak/scores':>12}{'max err':>9}"
    ]
    forward = [r for r in rows if r["method"] in LABELS]
    for r in sorted(forward, key=lambda r: (r["T"], list(LABELS).index(r["method"]))):
        lines.append(
            f"{r['T']:>6}  {LABELS[r['method']]:<34}{r['time_vs_sdpa_causal']:>10.2f}"
            f"{r['time_vs_sdpa_mask']:>10.2f}{r['matmul_fraction']:>10.0%}"
            f"{r['peak_bytes'] / 2**20:>10.1f}{r['os_peak_bytes'] / 2**20:>8.1f}"
            f"{r['peak_vs_scores']:>12.3f}{r['max_abs_err_vs_sdpa']:>9.1e}"
        )
    lines += [
        "time/SDPA, time/mask: median time over SDPA's (is_causal=True; explicit mask)",
        "of matmul: useful (visible-pair) FLOPs per second over the measured matmul rate",
        "peak: the allocator's peak during one call; OS: rise of the resident high-water mark",
    ]
    lines += _training_lines(rows) + [
        "",
        "growth exponents (value ~ T^k, least squares on log-log):",
    ]
    for method, fit in exponents.items():
        if fit["time"] is not None:
            label = LABELS.get(method) or TRAINING_LABELS[method] + ", fwd+bwd"
            sizes = ", ".join(map(str, fit["sizes"]))
            if fit["time_sizes"] != fit["sizes"]:
                sizes += f"; timed up to {max(fit['time_sizes'])}"
            lines.append(
                f"  {label:<42} time k = {fit['time']:.2f}   memory k = "
                f"{fit['memory']:.2f}   (T = {sizes})"
            )
    return "\n".join(lines)


def plot(rows: list, path: str) -> None:
    """Log-log plots against T: median time; forward peak memory; forward+backward peak memory."""
    from ..figures.plots import plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(14.0, 4.0))
    colors = dict(zip(LABELS, ["C0", "C1", "C2", "C3"]), naive_train="C0", tiled_train="C1")
    colors["sdpa_train"] = "C3"  # a method keeps its colour; forward+backward lines are dashed
    sizes = sorted({r["T"] for r in rows})
    for method, label in {**LABELS, **TRAINING_LABELS}.items():
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["T"])
        timed = [r for r in mine if r["median_s"] is not None]
        training = method in TRAINING_LABELS
        label = label + (", fwd+bwd" if training else "")
        marker = "s--" if training else "o-"
        style = {"label": label, "color": colors[method]}
        left.plot([r["T"] for r in timed], [r["median_s"] for r in timed], marker, **style)
        memory = [r.get("peak_bytes_one_head", r.get("peak_bytes")) / 2**20 for r in mine]
        (right if training else middle).plot([r["T"] for r in mine], memory, marker, **style)
    left.set(ylabel="median time (s)", title="time per call")
    middle.set(ylabel="peak extra MiB", title="forward: peak memory")
    right.set(ylabel="peak extra MiB", title="forward + backward: peak memory, one head")
    for ax in (left, middle, right):
        ax.set(xscale="log", yscale="log", xlabel="T (queries = keys)")
        ax.set_xticks(sizes, labels=[str(s) for s in sizes], minor=False)
        ax.set_xticks([], minor=True)  # no 3x10^3-style minor labels between the sizes
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
