"""The paged KV cache as a picture: one pool of blocks, the sequences' pages interleaved in it."""

from matplotlib.patches import Rectangle

from .plots import plt

COLOURS = plt.get_cmap("tab10").colors


def _holders(cache, seqs):
    """{block: [index of each sequence holding it]} and {block: tokens written in it}."""
    owner, fill = {}, {}
    for n, seq in enumerate(seqs):
        for index, block in enumerate(cache.tables[seq]):
            owner.setdefault(block, []).append(n)
            used = min(cache.block_size, cache.lengths[seq] - index * cache.block_size)
            fill[block] = max(fill.get(block, 0), used)
    return owner, fill


def _draw_pool(ax, cache, seqs, per_row):
    owner, fill = _holders(cache, seqs)
    blocks = len(cache.refs)
    rows = -(-blocks // per_row)
    for block in range(blocks):
        x, y = block % per_row, rows - 1 - block // per_row
        holders = owner.get(block, [])
        ax.add_patch(
            Rectangle(
                (x, y),
                0.95,
                0.9,
                facecolor=COLOURS[holders[0] % 10] if holders else "white",
                edgecolor="black",
                hatch="//" if len(holders) > 1 else None,
                alpha=0.85 if holders else 1,
            )
        )
        label = f"{block}\n{fill[block]}/{cache.block_size}" if holders else str(block)
        ax.text(x + 0.47, y + 0.45, label, ha="center", va="center", fontsize=6)
    ax.set_xlim(0, per_row)
    ax.set_ylim(0, rows)
    ax.set_axis_off()
    ax.set_title(f"pool: {blocks} blocks of {cache.block_size} tokens (id, tokens used)")


def block_table_figure(cache, seqs=None, per_row=16):
    """Draw the pool of `cache` (a PagedKVCache): each block coloured by the sequence holding it,
    hatched when several share it, with how full it is; beside it, each sequence's block table.
    """
    seqs = list(cache.tables) if seqs is None else list(seqs)
    rows = -(-len(cache.refs) // per_row)
    fig, (ax, tab) = plt.subplots(
        1, 2, figsize=(10, 0.5 * rows + 1.6), gridspec_kw={"width_ratios": [per_row, 7]}
    )
    _draw_pool(ax, cache, seqs, per_row)
    tab.set_axis_off()
    tab.set_title("block tables")
    for n, seq in enumerate(seqs):
        text = f"{seq} ({cache.lengths[seq]} tokens): {cache.tables[seq]}"
        tab.text(
            0, 1 - 0.14 * (n + 1), text, color=COLOURS[n % 10], fontsize=8,
            transform=tab.transAxes, family="monospace",
        )  # fmt: skip
    fig.tight_layout()
    return fig
