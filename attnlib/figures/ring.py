"""Ring attention in pictures: the ring of processes, the pairs each has computed step by step,
and the work of the three orderings of the shards side by side."""

import numpy as np
from matplotlib.patches import Circle, FancyArrowPatch, Patch

from ..lab.ring import shard_positions, tiles_computed
from .plots import plt
from .widgets import slider_views

COLOURS = plt.get_cmap("tab10").colors
ORDER_COLOURS = {"contiguous": "#4c72b0", "zigzag": "#dd8452", "striped": "#55a868"}


def ring_diagram(world=4, step=1):
    """The processes on a ring (eq. 22.1): each keeps its queries Q_r and, at `step`, holds
    the K/V shard of process (r - step) mod P; arrows show where each shard goes next."""
    fig, ax = plt.subplots(figsize=(5.6, 4.4))
    angles = np.pi / 2 - 2 * np.pi * np.arange(world) / world  # rank 0 on top, clockwise
    centres = np.stack([np.cos(angles), np.sin(angles)], 1) * 1.6
    for rank, (x, y) in enumerate(centres):
        ax.add_patch(Circle((x, y), 0.55, facecolor=COLOURS[rank], alpha=0.25, edgecolor="k"))
        held = (rank - step) % world
        label = f"process {rank}\nQ$_{rank}$ stays\nholds K,V$_{held}$"
        ax.text(x, y, label, ha="center", va="center", fontsize=8)
    for rank in range(world):
        start, end = centres[rank], centres[(rank + 1) % world]
        ax.add_patch(
            FancyArrowPatch(
                start,
                end,
                connectionstyle="arc3,rad=-0.25",
                arrowstyle="-|>",
                mutation_scale=14,
                shrinkA=34,
                shrinkB=34,
                color="0.3",
            )
        )
    ax.set_xlim(-2.5, 2.5)
    ax.set_ylim(-2.4, 2.4)
    ax.set_aspect("equal")
    ax.set_axis_off()
    ax.set_title(
        f"{world} processes (ranks 0-{world - 1}) at step {step}:\n"
        "each sends the K/V shard it holds to rank r + 1, receives from r - 1",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


def _pair_owner(world, length, order, tile, upto):
    """[T, T] arrays over (query position, key position): the process whose computed tile
    covers the pair by the end of step `upto` (-1 none), and whether the pair is visible."""
    owner = np.full((length, length), -1)
    held = [shard_positions(order, r, world, length).tolist() for r in range(world)]
    for step in range(upto + 1):
        for rank in range(world):
            keys_held = held[(rank - step) % world]
            for i in range(0, len(held[rank]), tile):
                queries = held[rank][i : i + tile]
                for j in range(0, len(keys_held), tile):
                    keys = keys_held[j : j + tile]
                    if tiles_computed(queries, keys, tile):  # the tile has a visible pair
                        owner[np.ix_(queries, keys)] = rank
    visible = np.arange(length)[None, :] <= np.arange(length)[:, None]
    return owner, visible


def ring_step_figure(world, length, order, tile, step):
    """The (query, key) pairs covered by the tiles computed by the end of `step` (eq. 22.2
    for contiguous shards), queries as rows, coloured by process; pale where a computed
    tile's pair is hidden by eq. 7.1 (work wasted)."""
    owner, visible = _pair_owner(world, length, order, tile, step)
    image = np.ones((length, length, 3)) * 0.95
    for rank in range(world):
        colour = np.array(COLOURS[rank])
        image[(owner == rank) & visible] = colour
        image[(owner == rank) & ~visible] = 0.35 * colour + 0.65
    fig, ax = plt.subplots(figsize=(6.2, 4.8))
    ax.imshow(image, interpolation="nearest")
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    held = [shard_positions(order, r, world, length) for r in range(world)]
    done = [
        sum(tiles_computed(held[r], held[(r - s) % world], tile) for s in range(step + 1))
        for r in range(world)
    ]
    holds = ", ".join(f"p{r}: K/V {(r - step) % world}" for r in range(world))
    ax.set_title(f"{order}, step {step}\nholds {holds}\ntiles so far {done}", fontsize=9)
    handles = [Patch(color=COLOURS[r], label=f"process {r}") for r in range(world)]
    handles.append(Patch(color=(0.75, 0.75, 0.75), label="computed, hidden"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    fig.tight_layout()
    return fig


def ring_slider(world, length, order, tile):
    """A slider over the ring's steps (works on the static page)."""
    from .plots import png_bytes

    return slider_views(
        f"{order} step",
        list(range(world)),
        lambda step: png_bytes(ring_step_figure(world, length, order, tile, step)),
    )


def orderings_figure(tiles_per_step):
    """The orderings side by side, from {order: [process][step] tiles computed}: the tiles
    each process computed (eq. 22.2 for contiguous shards), and the ring's length (the
    busiest process at each step, summed over the steps)."""
    orders = list(tiles_per_step)
    world = len(next(iter(tiles_per_step.values())))
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.0, 3.6))
    width = 0.8 / len(orders)
    for n, order in enumerate(orders):
        totals = [sum(steps) for steps in tiles_per_step[order]]
        x = np.arange(world) + (n - (len(orders) - 1) / 2) * width
        left.bar(x, totals, width, color=ORDER_COLOURS.get(order), label=order)
    left.set_xticks(range(world), labels=[f"process {r}" for r in range(world)])
    left.set_ylabel("tiles computed")
    left.set_title("work of each process", fontsize=10)
    left.legend(fontsize=8)
    lasts = [sum(max(column) for column in zip(*tiles_per_step[o])) for o in orders]
    means = [sum(map(sum, tiles_per_step[o])) / world for o in orders]
    x = np.arange(len(orders))
    right.bar(x - 0.2, lasts, 0.4, color=[ORDER_COLOURS.get(o) for o in orders])
    right.bar(x + 0.2, means, 0.4, color="0.8", label="total / P (perfect balance)")
    right.set_xticks(x, labels=orders)
    right.set_ylabel("tiles")
    right.set_title("the ring lasts (busiest process, step by step)", fontsize=10)
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig


def local_tiles_figure(world, length, tile, rank, step, orders=("contiguous", "zigzag", "striped")):
    """What process `rank` meets at `step`, one panel per ordering: its queries (rows) against
    the K/V shard it holds, both in the order it holds them, labelled with their positions.
    Dark: pairs eq. 7.1 shows; grey: hidden pairs in a computed tile; white: skipped tiles."""
    fig, axes = plt.subplots(1, len(orders), figsize=(3.4 * len(orders), 3.9))
    source = (rank - step) % world
    for ax, order in zip(np.atleast_1d(axes), orders):
        queries = shard_positions(order, rank, world, length)
        keys = shard_positions(order, source, world, length)
        visible = (keys[None, :] <= queries[:, None]).numpy()
        image = np.where(visible, 0.15, 1.0)
        skipped = 0
        for i in range(0, len(queries), tile):
            for j in range(0, len(keys), tile):
                if visible[i : i + tile, j : j + tile].any():
                    block = image[i : i + tile, j : j + tile]
                    block[block == 1.0] = 0.75
                else:
                    skipped += 1
        ax.imshow(image, cmap="gray", vmin=0, vmax=1, interpolation="nearest")
        ax.set_yticks(range(len(queries)), labels=queries.tolist(), fontsize=6)
        ax.set_xticks(range(len(keys)), labels=keys.tolist(), fontsize=6, rotation=90)
        for edge in range(tile, len(queries), tile):
            ax.axhline(edge - 0.5, color=ORDER_COLOURS.get(order, "k"), lw=1)
            ax.axvline(edge - 0.5, color=ORDER_COLOURS.get(order, "k"), lw=1)
        tiles = -(-len(queries) // tile) * -(-len(keys) // tile)
        ax.set_title(f"{order}: {tiles - skipped} of {tiles} tiles computed", fontsize=9)
        ax.set_xlabel(f"key position (shard {source})", fontsize=8)
        ax.set_ylabel(f"query position (process {rank})", fontsize=8)
    fig.tight_layout()
    return fig
