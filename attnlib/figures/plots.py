"""The book's one figure style. Imports matplotlib, so import this module only where you plot."""

import io

import matplotlib.pyplot as plt  # with no display matplotlib picks Agg; Jupyter shows inline

FIGSIZE = (5.0, 4.0)
CMAP = "viridis"
DPI = 100

plt.rcParams.update(
    {
        "figure.figsize": FIGSIZE,
        "figure.dpi": DPI,
        "axes.grid": False,
        "font.size": 10,
        "svg.hashsalt": "attnlib",  # deterministic output
    }
)


def heatmap(weights, row_labels, col_labels, title="", ax=None, vmax=1.0, annotate=True):
    """Attention weights [T, S] as a heatmap: queries as rows, keys as columns, token labels."""
    weights = weights.detach().cpu().float() if hasattr(weights, "detach") else weights
    if ax is None:
        _, ax = plt.subplots(figsize=FIGSIZE)
    image = ax.imshow(weights, cmap=CMAP, vmin=0.0, vmax=vmax)
    ax.set_xticks(range(len(col_labels)), labels=col_labels, rotation=45, ha="right")
    ax.set_yticks(range(len(row_labels)), labels=row_labels)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    if title:
        ax.set_title(title)
    if annotate and len(row_labels) * len(col_labels) <= 100:
        for i in range(len(row_labels)):
            for j in range(len(col_labels)):
                value = float(weights[i][j])
                colour = "white" if value < 0.6 * vmax else "black"
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8, color=colour)
    ax.figure.colorbar(image, ax=ax, label="attention weight (0-1)", fraction=0.046, pad=0.04)
    return ax


def png_bytes(fig) -> bytes:
    """Render a figure to PNG bytes and close it (for pre-rendered slider views)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return buffer.getvalue()
