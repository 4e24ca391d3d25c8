"""Figures of chapter 20: QK circuits as heatmaps, and the circuit scores across training."""

import math

import torch

from ..lab import circuits
from .plots import CMAP, plt, png_bytes


def causal(scores: torch.Tensor) -> torch.Tensor:
    """scores [T, T] with the keys after each query blanked (NaN), for display."""
    length = scores.shape[0]
    keep = torch.ones(length, length, dtype=torch.bool).tril()
    return scores.masked_fill(~keep, math.nan)


def qk_panels(axes, model, previous: int, head: int, name: str):
    """Two heatmaps on axes (a pair): the positional QK scores of layer 1's head `previous`,
    and layer 2's head `head` read through layer 1's OV (eq. 20.4)."""
    positional = causal(circuits.positional_qk(model, 0, previous))
    composed = circuits.composed_qk(model, previous, head)
    for ax, scores, title, labels in (
        (axes[0], positional, f"{name}: layer 1, head {previous}", ("query", "key")),
        (axes[1], composed, f"{name}: layer 2, head {head}", ("query token", "key's previous")),
    ):
        image = ax.imshow(scores.detach(), cmap=CMAP)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(labels[0] + (" position" if ax is axes[0] else ""), fontsize=8)
        ax.set_xlabel(labels[1] + (" position" if ax is axes[0] else " token"), fontsize=8)
        ax.tick_params(labelsize=6)
        ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="score")
    return axes


def side_by_side(trained, hand, previous: int, head: int):
    """A 2 x 2 figure: the trained model's QK panels above, the hand-built model's below."""
    fig, axes = plt.subplots(2, 2, figsize=(8.2, 7.4))
    qk_panels(axes[0], trained, previous, head, "trained")
    qk_panels(axes[1], hand, 0, 0, "by hand")
    fig.suptitle("QK circuits: positions in layer 1, tokens through layer 1's OV in layer 2")
    fig.tight_layout()
    return fig


def checkpoint_view(steps, series: dict, step, losses: dict, random_mean: float) -> bytes:
    """One slider view: every curve of `series` ({label: [value per step]}) over `steps`,
    a marker at `step`, the held-out copied loss / ln V there; PNG bytes."""
    fig, ax = plt.subplots(figsize=(7.0, 3.9), dpi=80)
    for label, values in series.items():
        ax.plot(steps, values, "-", lw=1.2, label=label)
        ax.plot(step, values[steps.index(step)], "ko", ms=4)
    ax.axhline(random_mean, color="k", linestyle=":", lw=0.8, label="K, random mean")
    ax.axvline(step, color="0.6", lw=0.8)
    ax.set(xlabel="training step", ylim=(0, 1.05))
    ax.set_title(f"step {step}: held-out copied loss {losses[step]:.2f} ln V", fontsize=10)
    ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    return png_bytes(fig)
