"""Chapter 18, induction heads: the induction score of eq. 18.2."""

import math

import torch

from ...softmax import softmax
from .cases import randn, tril
from .core import Bug, Case, Exercise, Section

CHAPTER = "18_induction_heads"
CLAIMS = Section(CHAPTER, "18.6", "Claims 2 and 3: a previous-token head and an induction head")

BUGS = {
    "induction_same_token": Bug(
        "This is the weight on the earlier occurrence of the query's own token (key i - o): a "
        "duplicate-token score. An induction head looks one further, at key i - o + 1.",
        CLAIMS,
    ),
    "induction_over_all_queries": Bug(
        "The mean ran over every query from position o - 1 on; the queries of eq. 18.2 are those "
        "whose next token is a copy, i from o to T - 2.",
        CLAIMS,
    ),
}


def _induction(weights, offset, first=None, back=None):
    """The mean over queries i = first .. T-2 of weights[:, i, i - back] (eq. 18.2's defaults)."""
    first, back = offset if first is None else first, offset - 1 if back is None else back
    i = torch.arange(first, weights.shape[-1] - 1)
    return weights.double()[:, i, i - back].mean(-1)


def _cases():
    gen, cases = torch.Generator().manual_seed(18), []
    for h, t, offset in [(2, 10, 4), (3, 16, 8), (1, 7, 3), (4, 12, 5)]:
        scores = 2 * randn(gen, h, t, t)
        weights = softmax(scores.masked_fill(~tril(t, t), -math.inf))  # [H, T, T], causal
        cases.append(Case((weights, offset), f"H={h}, T={t}, offset={offset}"))
    return cases


EXERCISES = {
    "induction_score": Exercise(
        "fn(weights, offset) -> scores; weights [H, T, T], offset o -> [H]",
        "Tokens o.. T-1 repeat tokens 0.. T-1-o. Each head's induction score, eq. 18.2: its mean "
        "weight on key i - o + 1 over the queries i = o .. T-2.",
        _cases,
        _induction,
        ("scores [H]",),
        {
            "induction_same_token": lambda w, offset: _induction(w, offset, back=offset),
            "induction_over_all_queries": lambda w, offset: _induction(w, offset, first=offset - 1),
        },
    ),
}
