"""Figures of chapter 19: the loss curve, head-score grids, the bracket head's closers and a
slider over every head. Layers are labelled from 1, heads from 0, as the chapters print them.

The slider pre-renders one small heatmap per head and switches between them in the browser
(`widgets.slider_views`), so it works on the static page with no kernel.
"""

import io

from .plots import CMAP, plt
from .widgets import slider_views


def loss_curve(steps, losses, heldout_loss=None):
    """Training loss (nats/token) against step, with the held-out loss as a line."""
    fig, ax = plt.subplots(figsize=(6.0, 3.2))
    ax.plot(steps, losses, lw=0.8, label="training batch")
    if heldout_loss is not None:
        ax.axhline(heldout_loss, color="black", ls="--", lw=1, label="held-out, after training")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    return fig


def score_grids(scores: dict, titles: dict):
    """One [layers x heads] grid per score, numbers written in the cells."""
    fig, axes = plt.subplots(1, len(titles), figsize=(3.0 * len(titles), 3.0))
    for ax, (name, title) in zip(axes, titles.items()):
        grid = scores[name]
        ax.imshow(grid, cmap=CMAP, vmin=0.0, vmax=1.0)
        for layer in range(grid.shape[0]):
            for head in range(grid.shape[1]):
                value = float(grid[layer, head])
                colour = "white" if value < 0.6 else "black"
                ax.text(head, layer, f"{value:.2f}", ha="center", va="center", color=colour)
        ax.set_xticks(range(grid.shape[1]))
        ax.set_yticks(range(grid.shape[0]), labels=range(1, grid.shape[0] + 1))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def bracket_split(split: dict, edges=(1, 3, 5, 9, 17)):
    """Closers by how far back their opener is (`lm_heads.bracket_breakdown`): how many, and on
    how many the head's largest weight lands on the opener and on the nearest bracket."""
    distance = split["distance"]
    bins = list(zip(edges, [*edges[1:], int(distance.max()) + 1]))
    labels = [f"{low}-{high - 1}" if high - 1 > low else f"{low}" for low, high in bins]
    labels[-1] = f"{bins[-1][0]}+"
    counts = {"closers": [], "largest weight on its opener": [], "on the nearest bracket": []}
    for low, high in bins:
        rows = (distance >= low) & (distance < high)
        counts["closers"].append(int(rows.sum()))
        counts["largest weight on its opener"].append(int(split["on_opener"][rows].sum()))
        counts["on the nearest bracket"].append(int(split["on_nearest"][rows].sum()))
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    width = 0.27
    for k, (label, values) in enumerate(counts.items()):
        ax.bar([i + (k - 1) * width for i in range(len(bins))], values, width, label=label)
    ax.set_xticks(range(len(bins)), labels=labels)
    ax.set_xlabel("tokens back from the closer to its opener")
    ax.set_ylabel("closers (count)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def head_pngs(weights, tokens, titles):
    """One PNG per head: weights [n, T, T] on a snippet, queries as rows, tokens on both axes.

    One figure is drawn and its image and title swapped, which is much faster than n figures.
    """
    fig, ax = plt.subplots(figsize=(5.6, 5.6), dpi=80)
    image = ax.imshow(weights[0], cmap=CMAP, vmin=0.0, vmax=1.0)
    ax.set_xticks(range(len(tokens)), labels=tokens, rotation=90, fontsize=8, family="monospace")
    ax.set_yticks(range(len(tokens)), labels=tokens, fontsize=8, family="monospace")
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    fig.subplots_adjust(left=0.2, bottom=0.2, right=0.98, top=0.94)
    pngs = []
    for view, title in zip(weights, titles):
        image.set_data(view)
        ax.set_title(title, fontsize=9)
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", metadata={"Software": None})
        pngs.append(buffer.getvalue())
    plt.close(fig)
    return pngs


def head_viewer(weights, tokens, start=0):
    """A slider over every (layer, head): weights is a list over layers of [Hq, T, T]."""
    layers, heads = len(weights), len(weights[0])
    pairs = [(layer, head) for layer in range(layers) for head in range(heads)]
    options = [f"L{layer + 1}H{head}" for layer, head in pairs]
    titles = [f"layer {layer + 1}, head {head}" for layer, head in pairs]
    stacked = [weights[layer][head] for layer in range(layers) for head in range(heads)]
    pngs = dict(zip(options, head_pngs(stacked, tokens, titles)))
    viewer = slider_views("layer, head", options, pngs.__getitem__, start=start)
    if hasattr(viewer, "summary"):  # a short, stable text form
        viewer.summary = f"slider over {options[0]}..{options[-1]}: {len(options)} views"
    return viewer


def readable(tokens):
    """Byte-level BPE pieces as text: 'Ġ' is a space, 'Ċ' a newline."""
    return [token.replace("Ġ", "·").replace("Ċ", "⏎").replace("ĉ", "⇥") for token in tokens]
