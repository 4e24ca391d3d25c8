"""Chapter 7, positions: queries at the end of the keys, and a left-padded batch. Defines
top_left_mask, which chapter 11's loops share."""

import math

import torch

from ...attention import causal_attention
from ...masks import left_padding
from .cases import attend, f64, identity_probe, qkv_cases, randn, ref_causal, tril
from .core import Bug, Case, Exercise, Section

CHAPTER = "07_positions"

BUGS = {
    "top_left_mask": Bug(
        "The mask is aligned top-left (key j visible to query i when j <= i), as SDPA's "
        "is_causal does; with T < S the new queries are the last T positions, so j <= S-T+i.",
        Section(CHAPTER, "7.7", "The `is_causal` pitfall: SDPA's top-left triangle"),
    ),
    "pads_not_masked": Bug(
        "The pads are not masked: real tokens attend to the pad slots before them. Combine the "
        "causal rule with a key mask that hides the pads.",
        Section(CHAPTER, "7.4", "Padded batches: positions per row"),
    ),
    "masked_row_nan": Bug(
        "A query that sees no key (a pad) gives NaN: softmax over a row of -inf is 0/0. Such a "
        "row must output zeros.",
        Section("05_causal_masking", "5.6.1", "A row with nothing to see"),
    ),
}


# ---- exercise 7.1: queries at the end of the keys -------------------------------------------


def top_left(q, k, v):
    """Attention with SDPA's is_causal triangle: key j visible to query i iff j <= i."""
    return attend(q, k, v, tril(q.shape[2], k.shape[2]))


def _decode_cases():
    shapes = [(2, 2, 2, 1, 7, 8), (1, 3, 3, 3, 9, 4), (2, 2, 2, 2, 5, 8), (1, 2, 2, 4, 4, 4)]
    return qkv_cases(shapes, 2)


# ---- exercise 7.2: a left-padded batch ------------------------------------------------------


def _ref_padded(q, k, v, lengths):
    positions, allowed = left_padding(lengths, q.shape[2])
    return causal_attention(*f64(q, k, v), positions, positions, allowed)


def _masked_row_nan(q, k, v, lengths):
    out = _ref_padded(q, k, v, lengths).clone()
    for b, n in enumerate(lengths):
        out[b, :, : q.shape[2] - n] = math.nan
    return out


def _padded_cases():
    gen, cases = torch.Generator().manual_seed(9), []
    for b, h, t, d, lengths in [
        (3, 2, 5, 8, [5, 3, 1]),
        (2, 1, 4, 4, [2, 4]),
        (2, 2, 3, 4, [0, 3]),
    ]:
        q, k, v = (randn(gen, b, h, t, d) for _ in range(3))
        cases.append(Case((q, k, v, lengths), f"B={b}, H={h}, T={t}, D={d}, lengths {lengths}"))
    return cases


def _padded_probe():
    """Two rows of the identity probe, the second with 2 pads in front of 4 tokens."""
    (q, k, eye), _ = identity_probe()
    q, k, eye = (torch.cat([x, x]) for x in (q, k, eye))  # B = 2
    pad_allowed = left_padding([6, 4], 6)[1]  # [2, 1, 1, 6]
    return (q, k, eye, [6, 4]), tril(6, 6) & pad_allowed


EXERCISES = {
    "decode_attention": Exercise(
        "fn(q, k, v) -> out; q [B, H, T, D], k and v [B, H, S, D] with T <= S -> [B, H, T, D]",
        "The T queries are the last T of S positions: key j is visible to query i iff j <= S-T+i.",
        _decode_cases,
        ref_causal,
        ("out [B, H, T, D]",),
        {"top_left_mask": top_left},
        lambda: identity_probe(t=3, s=8),
    ),
    "padded_attention": Exercise(
        "fn(q, k, v, lengths) -> out; q, k, v [B, H, T, D], lengths [B] ints -> [B, H, T, D]",
        "A left-padded batch: row b holds T - lengths[b] pads, then its tokens at positions "
        "0, 1, ...; causal among real tokens, no key is a pad, a pad's output is 0.",
        _padded_cases,
        _ref_padded,
        ("out [B, H, T, D]",),
        {
            "pads_not_masked": lambda q, k, v, lengths: ref_causal(q, k, v),
            "masked_row_nan": _masked_row_nan,
        },
        _padded_probe,
    ),
}
