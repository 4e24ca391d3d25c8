"""Chapter 25's figures: what three memories keep, recall against N/D, trained recall."""

import math

from matplotlib.patches import Rectangle

from .plots import plt

COLOURS = {"linear": "tab:blue", "delta": "tab:orange", "softmax": "tab:green"}
COLOURS.update({"gated_delta": "tab:red"})


def _grid(ax, left, bottom, rows, cols, cell, colour, label):
    ax.add_patch(Rectangle((left, bottom), cols * cell, rows * cell, facecolor=colour, alpha=0.35))
    for r in range(rows + 1):
        ax.plot([left, left + cols * cell], [bottom + r * cell] * 2, color=colour, lw=0.5)
    for c in range(cols + 1):
        ax.plot([left + c * cell] * 2, [bottom, bottom + rows * cell], color=colour, lw=0.5)
    ax.text(left + cols * cell / 2, bottom - 0.6, label, ha="center", va="top", fontsize=9)


def memories_figure(d: int, dv: int, tokens: int):
    """Three memories after `tokens` tokens, drawn to scale in numbers kept: an RNN's vector
    (D), softmax attention's KV cache (S rows of D + Dv), linear attention's matrix (D x Dv)."""
    fig, axes = plt.subplots(1, 3, figsize=(9.0, 3.4), width_ratios=[1, 2, 2])
    cell = 1.0
    panels = [
        (axes[0], [(d, 1, "tab:purple", f"y: {d} numbers")], "RNN (chapter 1)"),
        (
            axes[1],
            [(tokens, d, "tab:blue", "K"), (tokens, dv, "tab:green", "V")],
            f"KV cache (chapter 10): {tokens} x ({d} + {dv})",
        ),
        (axes[2], [(d, dv, "tab:orange", r"$\Omega$")], f"matrix state: {d} x {dv}"),
    ]
    ratios = (1, 2, 2)
    needed = [sum(cols + 1 for _, cols, _, _ in blocks) + 1 for _, blocks, _ in panels]
    unit = max(n / r for n, r in zip(needed, ratios))  # data width per unit of ratio
    for (ax, blocks, title), ratio in zip(panels, ratios):
        left = 0.0
        for rows, cols, colour, label in blocks:
            _grid(ax, left, 0.0, rows, cols, cell, colour, label)
            left += cols * cell + 1.0
        ax.set_xlim(-1, -1 + ratio * unit)  # the same scale in every panel
        ax.set_ylim(-2.5, max(tokens, d) + 1)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(title, fontsize=10)
    fig.suptitle(f"what each memory keeps after S = {tokens} tokens (one head)", fontsize=11)
    return fig


def recall_plot(curves: dict, estimate, d: int, ax=None):
    """Mean cosine of the read-out to the stored value against N/D, one curve per memory,
    with the crosstalk estimate (eq. 25.7) as a dashed line."""
    if ax is None:
        _, ax = plt.subplots(figsize=(5.6, 3.8))
    for memory, (ratios, cosines) in curves.items():
        ax.plot(ratios, cosines, "o-", color=COLOURS[memory], label=memory)
    ratios = sorted({r for rs, _ in curves.values() for r in rs})
    fine = [ratios[0] * math.exp(i / 40 * math.log(ratios[-1] / ratios[0])) for i in range(41)]
    ax.plot(fine, [estimate(r) for r in fine], "k--", lw=1, label="1/sqrt(1 + n/D)")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("n / D (pairs stored per feature)")
    ax.set_ylabel("cosine(read-out, stored value)")
    ax.set_title(f"one head of width D = {d}")
    ax.legend(fontsize=8)
    return ax


def mqar_plot(rows, ax=None):
    """Trained accuracy on MQAR against the number of pairs, one line per mixer."""
    if ax is None:
        _, ax = plt.subplots(figsize=(5.6, 3.6))
    for mixer in dict.fromkeys(row["mixer"] for row in rows):
        mine = [row for row in rows if row["mixer"] == mixer]
        pairs = [row["pairs"] for row in mine]
        ax.plot(pairs, [row["accuracy"] for row in mine], "o-", color=COLOURS[mixer], label=mixer)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("n (key/value pairs in the sequence)")
    ax.set_ylabel("accuracy on fresh sequences")
    ax.legend(fontsize=8)
    return ax
