"""Chapter 5, causal masking: causal attention written by the reader, and the ways a mask goes
wrong. Borrows scale_by_d and no_scale from chapter 3."""

from .cases import attend, identity_probe, qkv_cases, ref_causal, tril
from .ch03 import BUGS as CH03_BUGS
from .core import Bug, Exercise, Section

CHAPTER = "05_causal_masking"
MASK_ON_SCORES = Section(CHAPTER, "5.2", "The mask goes on the scores, before the softmax")
MASK_AFTER = Section(CHAPTER, "5.4", "Mask before the softmax, not after")

BUGS = {
    "softmax_over_queries": Bug(
        "The softmax runs over the queries (dim=-2) instead of the keys (dim=-1), so columns sum "
        "to 1 and each query's weights do not.",
        Section(CHAPTER, "5.8.3", "Exercise 5.3: over the keys, not over the queries"),
    ),
    "mask_after_softmax": Bug(
        "The future is zeroed after the softmax, so the rows no longer sum to 1 and the future "
        "still sets the denominator; mask with -inf before the softmax.",
        MASK_AFTER,
    ),
    "mask_after_softmax_renormalised": Bug(
        "Zeroing after the softmax and renormalising is exact on paper, but the softmax saw the "
        "future keys: when a future score dominates, the allowed weights underflow to 0 and the "
        "row becomes 0/0 = NaN. Mask with -inf before the softmax.",
        MASK_AFTER,
    ),
    "mask_inverted": Bug(
        "The mask's polarity is inverted: each query sees only its future keys (and the last "
        "query sees nothing). masked_fill fills where the mask is True, so pass ~allowed.",
        MASK_ON_SCORES,
    ),
    "mask_hides_diagonal": Bug(
        "The mask is off by one and hides the diagonal: key j is visible only when j < i, so a "
        "query cannot see itself and the first query sees nothing. The -inf belong strictly "
        "above the diagonal: triu(..., diagonal=1).",
        MASK_ON_SCORES,
    ),
}
BORROWED = {name: CH03_BUGS[name] for name in ("scale_by_d", "no_scale")}


def _causal_bug(visible=tril, **kw):
    """A wrong causal attention: attend with the [T, T] mask visible(T, T) and kw."""

    def wrong(q, k, v):
        t = q.shape[2]
        return attend(q, k, v, visible(t, t), **kw)

    return wrong


def _cases():
    shapes = [(2, 3, 3, 5, 5, 8), (1, 2, 2, 7, 7, 4), (3, 1, 1, 4, 4, 16), (1, 1, 1, 1, 1, 4)]
    return qkv_cases(shapes, 0, spike=True)


EXERCISES = {
    "causal_attention": Exercise(
        "fn(q, k, v) -> out; q, k, v [B, H, T, D] -> [B, H, T, D]",
        "Causal scaled dot-product attention, positions 0..T-1, scale 1/sqrt(D).",
        _cases,
        ref_causal,
        ("out [B, H, T, D]",),
        {
            "scale_by_d": lambda q, k, v: _causal_bug(scale=1 / q.shape[-1])(q, k, v),
            "no_scale": _causal_bug(scale=1.0),
            "softmax_over_queries": _causal_bug(dim=-2),
            "mask_after_softmax": _causal_bug(after="zero"),
            "mask_after_softmax_renormalised": _causal_bug(after="renormalise"),
            "mask_inverted": _causal_bug(lambda t, s: ~tril(t, s)),
            "mask_hides_diagonal": _causal_bug(lambda t, s: tril(t, s, -1)),
        },
        identity_probe,
    ),
}
