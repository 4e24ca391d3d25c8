"""Chapter 7, positions: queries at the end of the keys, a left-padded batch and a sliding
window. Defines top_left_mask, which chapter 11's loops share."""

import math

import torch

from ...attention import causal_attention
from ...masks import left_padding, sliding_window
from .cases import attend, f64, identity_probe, qkv_cases, randn, ref_causal, tril
from .core import Bug, Case, Exercise, Section

CHAPTER = "07_positions"
SLIDING = Section(CHAPTER, "7.5", "Sliding windows through `allowed`")

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
    "window_one_too_wide": Bug(
        "The window lets each query read w + 1 keys: pos(q) - pos(k) <= w where < w belongs. "
        "A window of w holds the query's own key and the w - 1 before it.",
        SLIDING,
    ),
    "window_one_too_narrow": Bug(
        "The window lets each query read only w - 1 keys (and a window of 1 reads none): the "
        "query's own key counts as one of its w.",
        SLIDING,
    ),
    "window_sees_future": Bug(
        "The window alone, pos(q) - pos(k) < w, holds for every future key too, whose "
        "difference is negative; join it to eq. 7.1, pos(k) <= pos(q), with a logical and.",
        SLIDING,
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


# ---- exercise 7.4: a window of your own ----------------------------------------------------


def _windowed(q, k, v, window, wide=0, future=False, top_left=False):
    """Attention under a window over positions (queries at the last T of S), written out, with
    the wrong versions: `wide` keys more, future keys visible, or the window laid over row
    and column numbers."""
    t, s = q.shape[2], k.shape[2]
    rows = torch.arange(t) if top_left else torch.arange(s - t, s)
    back = rows[:, None] - torch.arange(s)[None, :]  # [T, S]: how far back key j is
    allowed = (back < window + wide) & ((back >= 0) | future)
    return attend(q, k, v, allowed)


def _ref_window(q, k, v, window):
    t, s = q.shape[2], k.shape[2]
    allowed = sliding_window(torch.arange(s - t, s), torch.arange(s), window)  # [T, S]
    return causal_attention(*f64(q, k, v), allowed=allowed)


def _window_cases():
    gen, cases = torch.Generator().manual_seed(23), []
    for b, h, t, s, d, window in [
        (2, 2, 6, 6, 8, 3),
        (1, 2, 4, 12, 4, 3),
        (2, 1, 1, 9, 8, 4),
        (1, 3, 5, 5, 4, 1),
        (1, 2, 3, 7, 8, 10),
    ]:
        q, k, v = (randn(gen, b, h, n, d) for n in (t, s, s))
        tokens = f"T={t}" if s == t else f"T={t}, S={s}"
        cases.append(Case((q, k, v, window), f"B={b}, H={h}, {tokens}, D={d}, w={window}"))
    return cases


def _window_probe():
    """The identity probe, 3 queries at positions 5..7 against 8 keys, with a window of 3."""
    (q, k, eye), allowed = identity_probe(t=3, s=8)
    back = torch.arange(5, 8)[:, None] - torch.arange(8)[None, :]
    return (q, k, eye, 3), allowed & (back < 3)


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
    "window_attention": Exercise(
        "fn(q, k, v, window) -> out; q [B, H, T, D], k and v [B, H, S, D] with T <= S, window "
        "an int -> [B, H, T, D]",
        "A sliding window over positions: the T queries are the last T of S positions; query "
        "i reads key j iff 0 <= (S-T+i) - j < window.",
        _window_cases,
        _ref_window,
        ("out [B, H, T, D]",),
        {
            "window_one_too_wide": lambda q, k, v, w: _windowed(q, k, v, w, wide=1),
            "window_one_too_narrow": lambda q, k, v, w: _windowed(q, k, v, w, wide=-1),
            "window_sees_future": lambda q, k, v, w: _windowed(q, k, v, w, future=True),
            "top_left_mask": lambda q, k, v, w: _windowed(q, k, v, w, top_left=True),
        },
        _window_probe,
    ),
}
