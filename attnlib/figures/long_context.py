"""Chapter 24's figures: RoPE's frequencies under each rule, and the loss by position."""

import math

from ..rope_scaling import scaled_frequencies
from .plots import plt

RULE_LABELS = {  # rule -> label, in plot order
    "linear": "position interpolation",
    "dynamic": "NTK-aware",
    "yarn": "YaRN",
    "llama3": "Llama 3",
}


def frequency_figure(head_dim: int, theta: float, train_length: int, factor: float):
    """Each rule's theta_f' / theta_f against the wavelength 2 pi / theta_f of every pair,
    with T_train and T = factor * T_train marked: the rules for a model trained on
    `train_length` tokens stretched `factor` times."""
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    plain, _ = scaled_frequencies("default", head_dim, theta)
    wavelength = (2 * math.pi / plain).tolist()
    for rule, label in RULE_LABELS.items():
        options = {"factor": factor}
        if rule != "linear":
            options["train_length"] = train_length
        if rule == "dynamic":
            options.update(factor=1.0, seq_len=int(factor * train_length))
        freq, _ = scaled_frequencies(rule, head_dim, theta, **options)
        ax.plot(wavelength, (freq / plain).tolist(), marker=".", label=label)
    for x, text in ((train_length, "$T_\\text{train}$"), (factor * train_length, "$T$")):
        ax.axvline(x, color="grey", lw=0.8, ls="--")
        ax.text(x, 1.02, text, ha="center", va="bottom", fontsize=9)
    ax.set_xscale("log")
    ax.set_ylim(0, 1.25)
    ax.set_xlabel("wavelength of the pair, 2π/θ (tokens, log scale)")
    ax.set_ylabel("new θ / old θ")
    ax.set_title(f"D = {head_dim}, base {theta:g}, T = {factor:g} × {train_length}")
    ax.legend(fontsize=8, loc="upper right", framealpha=0.9)
    return fig


def loss_figure(curves: dict, train_length: int, smooth: int = 16):
    """Mean loss against position, one line per method (curves: label -> [positions] losses),
    averaged over blocks of `smooth` positions, with the training length marked."""
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    for label, losses in curves.items():
        values = losses.tolist() if hasattr(losses, "tolist") else list(losses)
        blocks = range(0, len(values) - smooth + 1, smooth)
        xs = [n + smooth / 2 for n in blocks]
        ax.plot(xs, [sum(values[n : n + smooth]) / smooth for n in blocks], label=label)
    ax.axvline(train_length, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("position in the window (tokens)")
    ax.set_ylabel(f"loss, nats (mean of {smooth} positions)")
    ax.legend(fontsize=8)
    return fig
