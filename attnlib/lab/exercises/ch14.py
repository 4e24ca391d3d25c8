"""Chapter 14, tiling: the online softmax, one block of keys at a time."""

import math

import torch

from ...softmax import softmax
from .cases import f64, randn, tril
from .core import Bug, Case, Exercise, Section

CHAPTER = "14_tiling"
ONLINE = Section(CHAPTER, "14.1", "Tiled attention: the softmax one block at a time")

BUGS = {
    "online_sum_not_rescaled": Bug(
        "When the running maximum grows, the running sum l must be multiplied by exp(m - m') "
        "like the output accumulator; here it is not.",
        ONLINE,
    ),
    "online_output_not_rescaled": Bug(
        "When the running maximum grows, the output accumulator o must be multiplied by "
        "exp(m - m') like the running sum; here it is not.",
        ONLINE,
    ),
}


def _reference(scores, values, block):
    scores, values = f64(scores, values)
    return softmax(scores, dim=-1) @ values


def _online(scores, values, block, rescale_sum=True, rescale_out=True):
    """Online softmax over key blocks (eqs. 14.1-14.2), optionally without a rescale."""
    scores, values = f64(scores, values)
    m = torch.full((scores.shape[0], 1), torch.finfo(torch.float64).min, dtype=torch.float64)
    ell = torch.zeros_like(m)
    o = torch.zeros(scores.shape[0], values.shape[1], dtype=torch.float64)
    for j in range(0, scores.shape[1], block):
        s = scores[:, j : j + block]
        new_m = torch.maximum(m, s.amax(-1, keepdim=True))
        alpha, w = torch.exp(m - new_m), torch.exp(s - new_m)
        ell = (ell * alpha if rescale_sum else ell) + w.sum(-1, keepdim=True)
        o = (o * alpha if rescale_out else o) + w @ values[j : j + block]
        m = new_m
    return o / ell.masked_fill(ell == 0, 1.0)


def _cases():
    gen, cases = torch.Generator().manual_seed(7), []
    for t, s, dv, block in [(3, 10, 4, 3), (4, 7, 2, 2), (2, 16, 3, 4), (5, 9, 4, 1)]:
        scores = 2 * randn(gen, t, s) + torch.linspace(0, 8, s)  # the maximum keeps moving
        cases.append(
            Case((scores, randn(gen, s, dv), block), f"T={t}, S={s}, Dv={dv}, block={block}")
        )
    scores = 2 * randn(gen, 4, 8) + torch.linspace(0, 8, 8)
    scores = scores.masked_fill(~tril(4, 8, 4), -math.inf)
    scores[0] = -math.inf  # a row that sees no key gives zeros
    cases.append(
        Case((scores, randn(gen, 8, 3), 3), "T=4, S=8, Dv=3, block=3, masked, row 0 all -inf")
    )
    return cases


def _probe():
    """values = identity: the output is the softmax of the scores, whose rows sum to 1."""
    scores = torch.linspace(0, 4, 24).reshape(4, 6)
    return (scores, torch.eye(6), 2), torch.ones(4, 6, dtype=torch.bool)


EXERCISES = {
    "online_softmax": Exercise(
        "fn(scores, values, block) -> out; scores [T, S], values [S, Dv] -> [T, Dv]",
        "softmax(scores) @ values one block of `block` keys at a time (a row of -inf gives 0).",
        _cases,
        _reference,
        ("out [T, Dv]",),
        {
            "online_sum_not_rescaled": lambda s, v, b: _online(s, v, b, rescale_sum=False),
            "online_output_not_rescaled": lambda s, v, b: _online(s, v, b, rescale_out=False),
        },
        _probe,
    ),
}
