"""Which key/value head each query head reads (eq. 9.1), drawn for every setting of the dial.

One row per number of key/value heads: the query heads on top, the key/value heads beneath,
a line from each query head to the key/value head it reads, one colour per group. The pairing
comes from attnlib's `repeat_kv`, so the picture shows what the library computes.
"""

import torch

import attnlib

from .plots import plt

NAMES = {1: "MQA"}


def kv_heads_read(q_heads: int, kv_heads: int) -> list:
    """The key/value head that each of the q_heads query heads reads, from `attnlib.repeat_kv`
    (eq. 9.1): repeat KV heads labelled 0..kv_heads-1 and read the label each query head gets."""
    labels = torch.arange(kv_heads).reshape(1, kv_heads, 1, 1)  # [1, Hkv, 1, 1]
    return attnlib.repeat_kv(labels, q_heads // kv_heads).flatten().tolist()


def _name(q_heads: int, kv_heads: int) -> str:
    return "MHA" if kv_heads == q_heads else NAMES.get(kv_heads, "GQA")


def _row(ax, top: float, q_heads: int, kv_heads: int) -> None:
    """One setting of the dial: query heads at height top, key/value heads at top - 1."""
    reads = kv_heads_read(q_heads, kv_heads)
    group = q_heads // kv_heads
    colours = plt.get_cmap("tab10")
    for g in range(kv_heads):
        x = g * group + (group - 1) / 2  # under the middle of its group
        ax.add_patch(plt.Rectangle((x - 0.4, top - 1.2), 0.8, 0.4, color=colours(g % 10)))
        ax.text(x, top - 1.0, str(g), ha="center", va="center", fontsize=7, color="white")
    for h, g in enumerate(reads):
        x_kv = g * group + (group - 1) / 2
        ax.plot([h, x_kv], [top - 0.2, top - 0.8], color=colours(g % 10), linewidth=1.2)
        ax.add_patch(plt.Rectangle((h - 0.4, top - 0.2), 0.8, 0.4, color="0.35"))
        ax.text(h, top, str(h), ha="center", va="center", fontsize=7, color="white")
    label = f"Hkv = {kv_heads} ({_name(q_heads, kv_heads)})"
    ax.text(-0.8, top - 0.5, label, ha="right", va="center", fontsize=9)


def plot_head_groups(q_heads: int = 16, kv_settings=(16, 8, 4, 2, 1)):
    """Draw `kv_heads_read` for each number of key/value heads in kv_settings, one row each."""
    fig, ax = plt.subplots(figsize=(9.0, 1.25 * len(kv_settings) + 0.4))
    for row, kv_heads in enumerate(kv_settings):
        _row(ax, -2.0 * row, q_heads, kv_heads)
    ax.set_xlim(-5.2, q_heads - 0.4)
    ax.set_ylim(-2.0 * len(kv_settings) + 0.6, 0.5)
    ax.set_axis_off()
    fig.subplots_adjust(left=0.01, right=0.99, top=0.92, bottom=0.02)
    ax.set_title(
        f"{q_heads} query heads (grey, top of each row) and the key/value head each reads",
        fontsize=10,
    )
    return fig
