"""Chapter 12, the Qwen3 lab: QK-norm, the RMSNorm of every head's query and key."""

import torch

from .cases import randn
from .core import Bug, Case, Exercise, Section

CHAPTER = "12_qwen3_lab"
MANUAL_PASS = Section(CHAPTER, "12.2", "The manual pass, step by step")

BUGS = {
    "rmsnorm_eps_outside_sqrt": Bug(
        "The epsilon was added after the square root: RMSNorm divides by sqrt(mean(x^2) + eps), "
        "with eps inside.",
        MANUAL_PASS,
    ),
    "rmsnorm_over_all_heads": Bug(
        "The mean of squares ran over all the heads' features (H * D); Qwen3's q_norm and k_norm "
        "normalise each head's D features on their own.",
        MANUAL_PASS,
    ),
}


def _reference(x, weight, eps, over=1):
    """RMSNorm over the last `over` axes (1: each head's D features) in float64."""
    x = x.double()
    squares = x.pow(2).flatten(-over).mean(-1)[(...,) + (None,) * over]
    return x / torch.sqrt(squares + eps) * weight.double()


def _eps_outside(x, weight, eps):
    x = x.double()
    return x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps) * weight.double()


def _cases():
    gen, cases = torch.Generator().manual_seed(17), []
    for b, t, h, d, eps in [(2, 3, 2, 4, 0.1), (1, 4, 3, 8, 0.5), (1, 2, 2, 6, 1e-6)]:
        x, weight = 0.3 * randn(gen, b, t, h, d), 1 + 0.5 * randn(gen, d)
        cases.append(Case((x, weight, eps), f"B={b}, T={t}, H={h}, D={d}, eps={eps:g}"))
    return cases


EXERCISES = {
    "qk_norm": Exercise(
        "fn(x, weight, eps) -> out; x [B, T, H, D], weight [D], eps a float -> [B, T, H, D]",
        "Qwen3's RMSNorm of every head's query or key vector, with gains `weight`.",
        _cases,
        _reference,
        ("out [B, T, H, D]",),
        {
            "rmsnorm_eps_outside_sqrt": _eps_outside,
            "rmsnorm_over_all_heads": lambda x, weight, eps: _reference(x, weight, eps, over=2),
        },
    ),
}
