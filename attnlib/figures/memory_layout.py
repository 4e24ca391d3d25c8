"""The transpose trap as a memory-layout picture (chapter 6).

A [T, H*D] tensor is stored row by row: token 0's H*D features, then token 1's, and so on.
`split_heads` (reshape to [T, H, D], then transpose) gives head h the features h*D..(h+1)*D-1
of every token. `reshape(H, T, D)` alone cuts the same memory into H consecutive blocks of
T*D numbers, so "head" 0 receives all the features of the first tokens. The picture colours
every number by the head it belongs to and writes the token it comes from.
"""

import torch

from .plots import plt

HEAD_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#e15759", "#76b7b2")


def origins(tokens: int, heads: int, width: int) -> torch.Tensor:
    """[T, H*D, 2]: for every number of the [T, H*D] tensor, (its token, its true head)."""
    token = torch.arange(tokens)[:, None].expand(tokens, heads * width)
    head = (torch.arange(heads * width) // width)[None, :].expand(tokens, heads * width)
    return torch.stack([token, head], dim=-1)


def splits(tokens: int, heads: int, width: int):
    """(right, wrong), each [H, T, D, 2]: the origins after `split_heads`, and after a bare
    `reshape(H, T, D)` of the same memory."""
    memory = origins(tokens, heads, width)  # [T, H*D, 2]
    right = memory.reshape(tokens, heads, width, 2).transpose(0, 1)
    wrong = memory.reshape(heads, tokens, width, 2)
    return right, wrong


def _grid(ax, grid, left, top, title):
    """Draw one [rows, cols, 2] grid of origins: colour = true head, text = token."""
    rows, cols = grid.shape[:2]
    for i in range(rows):
        for j in range(cols):
            token, head = grid[i, j].tolist()
            colour = HEAD_COLOURS[head % len(HEAD_COLOURS)]
            ax.add_patch(
                plt.Rectangle((left + j, top - i - 1), 1, 1, facecolor=colour, edgecolor="white")
            )
            ax.text(
                left + j + 0.5,
                top - i - 0.5,
                str(token),
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.text(left + cols / 2, top + 0.4, title, ha="center", va="bottom", fontsize=8)


def _draw_splits(ax, right, wrong, top: float, gap: float):
    """Draw right and wrong, each [H, T, D, 2], side by side from `top`: one [T, D] block per
    head, split_heads on the left, the bare reshape on the right, each under its heading."""
    heads, width = right.shape[0], right.shape[2]
    block = width + gap
    for h in range(heads):
        _grid(ax, right[h], h * block, top, f"head {h}")
        _grid(ax, wrong[h], (heads + 1) * block + h * block - gap, top, f"'head {h}'")
    ax.text(
        heads * block / 2 - gap / 2,
        top + 1.5,
        "split_heads: reshape, then transpose",
        ha="center",
        fontsize=9,
        weight="bold",
    )
    ax.text(
        (heads + 1) * block - gap + heads * block / 2 - gap / 2,
        top + 1.5,
        "reshape(H, T, D) alone",
        ha="center",
        fontsize=9,
        weight="bold",
    )


def _head_legend(ax, heads: int):
    """One coloured square per head, at the upper right."""
    handles = [
        plt.Rectangle((0, 0), 1, 1, facecolor=HEAD_COLOURS[h % len(HEAD_COLOURS)])
        for h in range(heads)
    ]
    ax.legend(
        handles,
        [f"belongs to head {h}" for h in range(heads)],
        loc="upper right",
        fontsize=8,
        frameon=False,
        bbox_to_anchor=(1.0, 1.0),
    )


def plot_transpose_trap(tokens: int = 6, heads: int = 3, width: int = 4, ax=None):
    """The memory of a [T, H*D] tensor, and the H blocks that each way of splitting makes of it.

    Returns the axes. Each cell is one number: its colour is the head it belongs to, its text
    the token it comes from; memory is read left to right, then down.
    """
    right, wrong = splits(tokens, heads, width)
    if ax is None:
        _, ax = plt.subplots(figsize=(9.5, 5.2))
    gap = 1.5
    # Top: the memory, [T, H*D].
    _grid(
        ax,
        origins(tokens, heads, width),
        0,
        0,
        f"memory of q_flat, [T, H*D] = [{tokens}, {heads * width}], read row by row"
        " (digit = token)",
    )
    # Below: right and wrong splits, one [T, D] block per head.
    top = -tokens - 2.5
    _draw_splits(ax, right, wrong, top, gap)
    _head_legend(ax, heads)
    ax.set_xlim(-0.5, (2 * heads + 1) * (width + gap))
    ax.set_ylim(top - tokens - 0.5, 1.8)
    ax.set_aspect("equal")
    ax.axis("off")
    return ax
