"""Chapter 15, kernels that know the mask: the tiles a block mask lists, counted from positions."""

import torch

from .core import Bug, Case, Exercise, Section

CHAPTER = "15_flex_windows_fusion"
MASK_MOD = Section(CHAPTER, "15.2", "The positions rule as a FlexAttention `mask_mod`")

BUGS = {
    "block_window_one_too_wide": Bug(
        "The window kept the key at distance exactly `window`; the rule keeps a key while "
        "pos(q) - pos(k) < window, so each query sees `window` keys, its own included.",
        MASK_MOD,
    ),
    "block_pads_visible": Bug(
        "A key at a negative position is a pad, and no query may see it; the rule needs the "
        "term pos(k) >= 0 as well as pos(k) <= pos(q).",
        MASK_MOD,
    ),
    "block_listed_without_full": Bug(
        "Only the partly visible tiles were counted as listed. A block mask lists the tiles that "
        "still need the rule and, apart, the fully visible ones; the kernel computes both kinds.",
        MASK_MOD,
    ),
}


def _visible(query_positions, key_positions, window, reach=0, pads=True):
    """[T, S] booleans: the positions rule with pads and a window (reach widens the window)."""
    q, k = query_positions[:, None], key_positions[None, :]
    seen = (k <= q) & (q - k < window + reach)
    return seen & (k >= 0) if pads else seen


def _count(visible, block, full_listed=True):
    """(listed, full) tiles of block x block pairs (the last ones may be smaller), as floats."""
    listed = full = 0
    for i in range(0, visible.shape[0], block):
        for j in range(0, visible.shape[1], block):
            tile = visible[i : i + block, j : j + block]
            whole = bool(tile.all())
            listed += bool(tile.any()) and (full_listed or not whole)
            full += whole
    return float(listed), float(full)


def _reference(query_positions, key_positions, block, window):
    return _count(_visible(query_positions, key_positions, window), block)


def _cases():
    pads = torch.cat([torch.full((5,), -1), torch.arange(15)])  # 5 pads, then positions 0..14
    return [
        Case((torch.arange(16), torch.arange(16), 4, 16), "T=S=16, block=4, window=16"),
        Case((torch.arange(24), torch.arange(24), 4, 5), "T=S=24, block=4, window=5"),
        Case((torch.arange(20, 28), torch.arange(28), 4, 8), "T=8, S=28, block=4, window=8"),
        Case((pads[-8:], pads, 4, 20), "T=8, S=20 with 5 pads, block=4, window=20"),
        Case((torch.arange(10), torch.arange(10), 4, 3), "T=S=10, block=4, window=3"),
    ]


EXERCISES = {
    "block_counts": Exercise(
        "fn(query_positions, key_positions, block, window) -> (listed, full); positions [T], [S]",
        "Tiles of block x block pairs with a visible pair (listed) and with every pair visible.",
        _cases,
        _reference,
        ("listed (a number)", "full (a number)"),
        {
            "block_window_one_too_wide": lambda q, k, b, w: _count(_visible(q, k, w, reach=1), b),
            "block_pads_visible": lambda q, k, b, w: _count(_visible(q, k, w, pads=False), b),
            "block_listed_without_full": lambda q, k, b, w: _count(
                _visible(q, k, w), b, full_listed=False
            ),
        },
    ),
}
