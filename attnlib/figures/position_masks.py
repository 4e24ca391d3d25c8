"""The masks of the positions rule, eq. 7.1, drawn before chapter 7 describes them.

Four small cases, each a boolean grid with queries as rows and keys as columns, every row and
column labelled with its position: a sequence attending to itself, a chunk of queries at the end
of the keys, a left-padded row (its pads hidden through `allowed`), and a sliding window. Every
grid comes from attnlib's own `visible`, `left_padding` and `sliding_window`.
"""

import torch

import attnlib

from .plots import plt

ALLOWED, HIDDEN = "#4e79a7", "#e8e8e8"


def mask_panels() -> list:
    """(title, query positions [T], key positions [S], mask [T, S] bool) for each of the four
    cases of the figure: eq. 7.1, joined with `allowed` for the pads and the window."""
    six = torch.arange(6)
    chunk = torch.arange(3, 6)
    positions, allowed = attnlib.left_padding([4], total=6)  # [1, 6], [1, 1, 1, 6]
    window = attnlib.sliding_window(six, six, 3)  # [6, 6]
    return [
        ("a sequence: T = S = 6", six, six, attnlib.visible(six[None], six[None])[0, 0]),
        (
            "a chunk: 3 queries, 6 keys",
            chunk,
            six,
            attnlib.visible(chunk[None], six[None])[0, 0],
        ),
        (
            "left padding: 2 pads",
            positions[0],
            positions[0],
            (attnlib.visible(positions, positions) & allowed)[0, 0],
        ),
        ("a window: w = 3", six, six, attnlib.visible(six[None], six[None])[0, 0] & window),
    ]


def _labels(positions, pads: bool) -> list:
    """Tick labels: the positions, with the pads' negative ones marked."""
    return [f"{p}" + (" pad" if pads and p < 0 else "") for p in positions.tolist()]


def plot_position_masks():
    """Draw `mask_panels()` side by side: a filled square where the query may read the key."""
    panels = mask_panels()
    fig, axes = plt.subplots(1, len(panels), figsize=(11.0, 3.3), layout="constrained")
    colours = plt.matplotlib.colors.ListedColormap([HIDDEN, ALLOWED])
    for ax, (title, query_positions, key_positions, mask) in zip(axes, panels):
        pads = bool((key_positions < 0).any())
        ax.imshow(mask.int().numpy(), cmap=colours, vmin=0, vmax=1)
        ax.set_xticks(range(len(key_positions)), labels=_labels(key_positions, pads))
        ax.set_yticks(range(len(query_positions)), labels=_labels(query_positions, pads))
        ax.tick_params(axis="x", labelrotation=90 if pads else 0)
        ax.set_xticks([x - 0.5 for x in range(1, len(key_positions))], minor=True)
        ax.set_yticks([y - 0.5 for y in range(1, len(query_positions))], minor=True)
        ax.grid(which="minor", color="white", linewidth=1.5)
        ax.tick_params(which="minor", length=0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("key position")
    axes[0].set_ylabel("query position")
    return fig
