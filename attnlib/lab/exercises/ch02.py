"""Chapter 2, queries, keys and values: one layer of projections, then attention."""

import math

import torch

from ...softmax import softmax
from .cases import f64, randn
from .core import Bug, Case, Exercise, Section

CHAPTER = "02_queries_keys_values"

BUGS = {
    "keys_projected_by_w_q": Bug(
        "The keys were made with W_Q, so the scores are q_i . q_j: symmetric again, as without "
        "projections; keys need their own matrix W_K.",
        Section(CHAPTER, "2.1", "What plain dot products cannot do"),
    ),
    "scale_by_value_width": Bug(
        "The scores were divided by sqrt(d_v), the width of the values; the dot products are "
        "d_k wide, so the scale is 1/sqrt(d_k).",
        Section("03_scaling", "3.1", "How large is a dot product?"),
    ),
}


def _reference(x, w_q, w_k, w_v, key_matrix=None, width=None):
    """Eqs. 2.1-2.2 in float64; key_matrix and width plant the two bugs."""
    x, w_q, w_k, w_v = f64(x, w_q, w_k, w_v)
    q, k = x @ w_q, x @ (w_k if key_matrix is None else key_matrix.double())
    width = w_k.shape[1] if width is None else width
    return softmax(q @ k.T / math.sqrt(width)) @ (x @ w_v)


def _keys_by_w_q(x, w_q, w_k, w_v):
    return _reference(x, w_q, w_k, w_v, key_matrix=w_q)


def _scale_by_value_width(x, w_q, w_k, w_v):
    return _reference(x, w_q, w_k, w_v, width=w_v.shape[1])


def _cases():
    gen, cases = torch.Generator().manual_seed(12), []
    for t, dm, dk, dv in [(6, 3, 2, 4), (5, 4, 3, 2), (1, 3, 2, 5), (4, 6, 5, 3)]:
        args = (randn(gen, t, dm), randn(gen, dm, dk), randn(gen, dm, dk), randn(gen, dm, dv))
        cases.append(Case(args, f"T={t}, d_model={dm}, d_k={dk}, d_v={dv}"))
    return cases


EXERCISES = {
    "qkv_attention": Exercise(
        "fn(x, w_q, w_k, w_v) -> out; x [T, d_model], w_q and w_k [d_model, d_k], "
        "w_v [d_model, d_v] -> [T, d_v]",
        "Project x into Q, K and V (eq. 2.1) and attend (eq. 2.2) with no mask.",
        _cases,
        _reference,
        ("out [T, d_v]",),
        {"keys_projected_by_w_q": _keys_by_w_q, "scale_by_value_width": _scale_by_value_width},
    ),
}
