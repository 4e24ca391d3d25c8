"""Chapter 3, scaling: the scores q k^T / sqrt(D). Defines scale_by_d and no_scale, which
chapter 5's causal attention shares."""

import math

import torch

from .cases import f64, randn
from .core import Bug, Case, Exercise, Section

CHAPTER = "03_scaling"
WHY_SQRT_D = Section(CHAPTER, "3.3", r"Why $\sqrt{d}$, and not $d$ or nothing")

BUGS = {
    "scale_by_d": Bug(
        "The scores are divided by D instead of sqrt(D); the logits shrink as D grows and the "
        "softmax flattens towards uniform.",
        WHY_SQRT_D,
    ),
    "no_scale": Bug(
        "The scores are never multiplied by 1/sqrt(D); their spread grows like sqrt(D) and the "
        "softmax saturates.",
        WHY_SQRT_D,
    ),
    "scale_by_key_count": Bug(
        "The scores were divided by sqrt(S), the number of keys; the variance of a dot product "
        "grows with its width D, so the scale is 1/sqrt(D).",
        Section(CHAPTER, "3.1", "How large is a dot product?"),
    ),
}


def _reference(q, k, scale=None):
    q, k = f64(q, k)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return q @ k.transpose(-2, -1) * scale


def _cases():
    gen, cases = torch.Generator().manual_seed(13), []
    for b, h, t, s, d in [(2, 2, 3, 5, 8), (1, 3, 4, 4, 16), (1, 1, 6, 2, 4), (2, 1, 1, 7, 9)]:
        args = (randn(gen, b, h, t, d), randn(gen, b, h, s, d))
        cases.append(Case(args, f"B={b}, H={h}, T={t}, S={s}, D={d}"))
    return cases


EXERCISES = {
    "scaled_scores": Exercise(
        "fn(q, k) -> scores; q [B, H, T, D], k [B, H, S, D] -> [B, H, T, S]",
        "The scaled scores of eq. 3.3, q k^T / sqrt(D), for every query and key.",
        _cases,
        _reference,
        ("scores [B, H, T, S]",),
        {
            "scale_by_d": lambda q, k: _reference(q, k, 1 / q.shape[-1]),
            "no_scale": lambda q, k: _reference(q, k, 1.0),
            "scale_by_key_count": lambda q, k: _reference(q, k, 1 / math.sqrt(k.shape[-2])),
        },
    ),
}
