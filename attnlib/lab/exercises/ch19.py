"""Chapter 19, a language model: a head score of its own, the weight on the start of the line."""

import math

import torch

from ...softmax import softmax
from .cases import randn, tril
from .core import Bug, Case, Exercise, Section

CHAPTER = "19_language_model"
HEADS_AT_WORK = Section(CHAPTER, "19.6", "Heads at work")

BUGS = {
    "line_start_after_break": Bug(
        "The mean kept the queries whose line break is the token just before them. There the "
        "start of the line is key i - 1, where every previous-token head looks anyway; leave "
        "out the queries with n(i) = i - 1.",
        HEADS_AT_WORK,
    ),
    "line_start_over_all_queries": Bug(
        "The mean ran over every query, counting 0 for those without a break before them; like "
        "the scores of eq. 19.2, it runs over the queries the score is about, those with a "
        "break at n(i) < i - 1.",
        HEADS_AT_WORK,
    ),
}


def _line_start(weights, newline, after_break=False, over_all=False):
    """Per head: the mean weight from query i on the last break before it, key n(i) (float64)."""
    weights = weights.double()
    t = newline.shape[-1]
    positions = torch.arange(t)
    marks = torch.where(newline.bool(), positions, torch.full_like(positions, -1))
    last = marks.cummax(-1).values  # [B, T]: the last break at or before each position
    start = torch.cat([torch.full_like(last[:, :1], -1), last[:, :-1]], -1)  # before i
    counted = start >= 0 if after_break else (start >= 0) & (start < positions - 1)
    picked = weights.gather(-1, start.clamp(min=0)[:, None, :, None].expand(*weights.shape[:3], 1))
    total = (picked[..., 0] * counted[:, None]).sum((0, 2))  # [H]
    return total / (counted.numel() if over_all else counted.sum())


def _cases():
    gen, cases = torch.Generator().manual_seed(17), []
    for b, h, t, breaks in [
        (2, 2, 12, [[3, 4, 9], [0, 6]]),
        (1, 3, 16, [[2, 3, 7, 8, 15]]),
        (2, 1, 10, [[], [1, 5]]),
        (1, 2, 8, [[0, 4]]),
    ]:
        scores = 2 * randn(gen, b, h, t, t)
        weights = softmax(scores.masked_fill(~tril(t, t), -math.inf))  # [B, H, T, T], causal
        newline = torch.zeros(b, t, dtype=torch.bool)
        for row, where in enumerate(breaks):
            newline[row, where] = True
        label = f"B={b}, H={h}, T={t}, breaks at {'; '.join(map(str, breaks))}"
        cases.append(Case((weights, newline), label.replace("[]", "none")))
    return cases


EXERCISES = {
    "line_start_score": Exercise(
        "fn(weights, newline) -> scores; weights [B, H, T, T], newline [B, T] bool -> [H]",
        "Each head's mean weight from query i on key n(i), the last position before i whose "
        "token holds a line break, over the queries with n(i) < i - 1.",
        _cases,
        _line_start,
        ("scores [H]",),
        {
            "line_start_after_break": lambda w, nl: _line_start(w, nl, after_break=True),
            "line_start_over_all_queries": lambda w, nl: _line_start(w, nl, over_all=True),
        },
    ),
}
