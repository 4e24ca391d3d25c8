"""Chapter 23's figures: the three decode paths of MLA, the cache's bytes, a quantised row."""

from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from .plots import plt

# The three paths of one decode step, each a chain of (label, shape) boxes read left to right.
PATHS = {
    "naive: re-expand the latent cache": [
        ("latent cache\n[S, d_C + d_R]", "cache"),
        ("c W_UK, c W_UV\nevery step", "work"),
        ("K [H, S, Dn + d_R]\nV [H, S, Dv]", "big"),
        ("attention\nH heads", "work"),
        ("W_O", "work"),
    ],
    "expanded cache: store K and V": [
        ("K, V cache\n[H, S, Dn + d_R + Dv]", "big"),
        ("attention\nH heads", "work"),
        ("W_O", "work"),
    ],
    "absorbed: attend over the latents": [
        ("latent cache\n[S, d_C + d_R]", "cache"),
        ("q W_UK^T | q_R\n[H, d_C + d_R]", "work"),
        ("one shared head\n(MQA over latents)", "work"),
        ("W_UV W_O\nfolded", "work"),
    ],
}
COLOURS = {"cache": "#cfe8cf", "big": "#f4c7c3", "work": "#dde6f5"}


def decode_paths():
    """The data flow of one decode step, three ways: what each reads from memory (left),
    what it computes, and where the per-head maps go. Returns the figure."""
    fig, ax = plt.subplots(figsize=(9.0, 3.6))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, len(PATHS))
    ax.axis("off")
    for row, (title, boxes) in enumerate(PATHS.items()):
        y = len(PATHS) - row - 0.62
        ax.text(0.05, y + 0.42, title, fontsize=10, weight="bold")
        width, gap = 1.6, 0.4
        for n, (label, kind) in enumerate(boxes):
            x = 0.05 + n * (width + gap)
            box = FancyBboxPatch(
                (x, y - 0.2), width, 0.45, boxstyle="round,pad=0.03", fc=COLOURS[kind], ec="0.3"
            )
            ax.add_patch(box)
            ax.text(x + width / 2, y + 0.02, label, ha="center", va="center", fontsize=7.5)
            if n:
                ax.add_patch(
                    FancyArrowPatch(
                        (x - gap, y + 0.02), (x, y + 0.02), arrowstyle="-|>", mutation_scale=12
                    )
                )
    handles = [plt.Rectangle((0, 0), 1, 1, fc=c, ec="0.3") for c in COLOURS.values()]
    labels = ["small: d_C + d_R a token", "large: grows with H", "computed"]
    fig.legend(handles, labels, loc="lower center", fontsize=8, frameon=False, ncol=3)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def bytes_bars(rows: dict, title: str):
    """Horizontal bars of bytes per token ({label: bytes}), log scale, with the numbers."""
    fig, ax = plt.subplots(figsize=(7.0, 0.45 * len(rows) + 1.2))
    labels, values = list(rows), list(rows.values())
    ax.barh(range(len(rows)), values, color="#4c72b0")
    ax.set_yticks(range(len(rows)), labels=labels)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("cache bytes per token (bfloat16, all layers)")
    ax.set_title(title)
    for n, value in enumerate(values):
        ax.text(value * 1.05, n, f"{value / 1024:,.1f} KiB", va="center", fontsize=8)
    ax.set_xlim(min(values) / 2, max(values) * 4)
    fig.tight_layout()
    return fig


def quantised_row(exact, quantised, bits: int, bound: float, moved: float):
    """One query's attention weights over its keys, exact and with quantised keys."""
    fig, ax = plt.subplots(figsize=(6.4, 3.0))  # a slider view: within the page
    keys = range(len(exact))
    ax.plot(keys, exact, "k-", lw=1.2, label="keys exact")
    ax.plot(keys, quantised, "-", color="#dd8452", lw=1.0, label=f"keys at {bits} bits")
    ax.set_xlabel("key position j")
    ax.set_ylabel("attention weight a_j")
    ax.set_title(f"{bits} bits: weight moved {moved:.3f} of 2, bound {bound:.3f}")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return fig
