"""Ring attention as steps: which K/V shard each process holds, which tiles it has computed."""

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from ..lab.ring import shard_runs, tiles_computed
from .plots import plt
from .widgets import slider_views

COLOURS = plt.get_cmap("tab10").colors


def _tile_owner(world, length, order, tile, upto):
    """[tiles, tiles] array: -1 hidden or not yet computed, else the process that computed it."""
    count = length // tile
    grid = np.full((count, count), -1)
    runs = [shard_runs(order, r, world, length) for r in range(world)]
    for step in range(upto + 1):
        for rank in range(world):
            source = (rank - step) % world
            for q_start, q_stop in runs[rank]:
                for k_start, k_stop in runs[source]:
                    for qi in range(q_start // tile, -(-q_stop // tile)):
                        for kj in range(k_start // tile, -(-k_stop // tile)):
                            if kj * tile < (qi + 1) * tile:  # the tile holds a visible pair
                                grid[qi, kj] = rank
    return grid


def ring_step_figure(world, length, order, tile, step):
    """The causal tiles (queries as rows, keys as columns) computed by the end of `step`,
    coloured by process, and the shard each process holds at that step."""
    grid = _tile_owner(world, length, order, tile, step)
    cmap = ListedColormap(["#f2f2f2"] + [COLOURS[r] for r in range(world)])
    fig, ax = plt.subplots(figsize=(6.2, 4.6))
    ax.imshow(grid + 1, cmap=cmap, vmin=0, vmax=world, interpolation="nearest")
    ax.set_xlabel(f"key tile ({tile} positions each)")
    ax.set_ylabel(f"query tile ({tile} positions each)")
    runs = [shard_runs(order, r, world, length) for r in range(world)]
    done = [
        sum(tiles_computed(runs[r], runs[(r - s) % world], tile) for s in range(step + 1))
        for r in range(world)
    ]
    held = ", ".join(f"p{r}: K/V {(r - step) % world}" for r in range(world))
    ax.set_title(f"{order}, step {step}\nholds {held}\ntiles so far {done}", fontsize=9)
    handles = [Patch(color=COLOURS[r], label=f"process {r}") for r in range(world)]
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
