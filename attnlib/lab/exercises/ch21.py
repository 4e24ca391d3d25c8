"""Chapter 21, merging partials: two partial attentions over disjoint keys, merged (eq. 21.1)."""

import math

import torch

from ...merge import merge_attention
from .cases import f64, randn
from .core import Bug, Case, Exercise, Section

CHAPTER = "21_merging_partials"
TWO_PARTIALS = Section(CHAPTER, "21.1", "Two partial answers, one exact answer")

BUGS = {
    "merge_plain_average": Bug(
        "The two partial outputs were averaged with equal weights; each part weighs "
        "e^(lse_part - lse), its share of the whole softmax's denominator.",
        TWO_PARTIALS,
    ),
    "merge_without_max": Bug(
        "e^lse was taken without a shift: it overflows for lse above about 88 in float32, and "
        "a query that saw no key in either part gives -inf - (-inf) = NaN. Shift by the larger "
        "lse, and give a part with lse = -inf the weight 0.",
        TWO_PARTIALS,
    ),
}


def _reference(out_a, lse_a, out_b, lse_b):
    return merge_attention(*f64(out_a, lse_a, out_b, lse_b))


def _plain_average(out_a, lse_a, out_b, lse_b):
    out_a, lse_a, out_b, lse_b = f64(out_a, lse_a, out_b, lse_b)
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def _without_max(out_a, lse_a, out_b, lse_b):
    lse = torch.log(lse_a.float().exp() + lse_b.float().exp())  # float32: inf above 88
    out = (lse_a - lse).exp()[..., None] * out_a + (lse_b - lse).exp()[..., None] * out_b
    return out.double(), lse.double()


def _cases():
    gen, cases = torch.Generator().manual_seed(20), []
    for shape, shift in [((2, 2, 3, 4), 0.0), ((1, 3, 5, 2), 100.0), ((2, 1, 4, 3), 0.0)]:
        out_a, out_b = randn(gen, *shape), randn(gen, *shape)
        lse_a, lse_b = (3 * randn(gen, *shape[:-1]) + shift for _ in "ab")
        label = f"out {list(shape)}" + (f", lse near {shift:g}" if shift else "")
        cases.append(Case((out_a, lse_a, out_b, lse_b), label))
    out_a, out_b = randn(gen, 1, 1, 3, 2), torch.zeros(1, 1, 3, 2)
    lse_a, lse_b = torch.tensor([[[0.5, -math.inf, 2.0]]]), torch.full((1, 1, 3), -math.inf)
    out_a[0, 0, 1] = 0.0  # a query that saw no key in either part
    cases.append(Case((out_a, lse_a, out_b, lse_b), "parts with lse = -inf"))
    return cases


EXERCISES = {
    "merge_partials": Exercise(
        "fn(out_a, lse_a, out_b, lse_b) -> (out, lse); out [..., T, Dv], lse [..., T]",
        "Two partial attentions over disjoint keys merged into one (eq. 21.1); lse = -inf where a "
        "query saw no key in a part.",
        _cases,
        _reference,
        ("out [..., T, Dv]", "lse [..., T]"),
        {"merge_plain_average": _plain_average, "merge_without_max": _without_max},
    ),
}
