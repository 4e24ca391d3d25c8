"""Chapter 5, causal masking: causal attention written by the reader, and the ways a mask goes
wrong; a prefix language model's mask (a prompt read both ways, causal after it). Borrows
scale_by_d and no_scale from chapter 3."""

import torch

from .cases import attend, identity_probe, qkv_cases, ref_causal, tril
from .ch03 import BUGS as CH03_BUGS
from .core import Bug, Case, Exercise, Section

CHAPTER = "05_causal_masking"
MASK_ON_SCORES = Section(CHAPTER, "5.2", "The mask goes on the scores, before the softmax")
MASK_AFTER = Section(CHAPTER, "5.4", "Mask before the softmax, not after")
WHY_HIDDEN = Section(CHAPTER, "5.1", "Why the future has to be hidden")
DIRECT_CHECK = Section(CHAPTER, "5.5", "The direct check of causality")

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
    "prefix_left_causal": Bug(
        "The prompt is left causal: a prompt query reads only the keys up to its own position, "
        "as if the prompt were text to predict. The mask hides only what the model must "
        "predict; the prompt is given, so query i may read key j when j <= i or j < P.",
        WHY_HIDDEN,
    ),
    "prefix_sees_suffix": Bug(
        "The prompt's queries read every key, the tokens after the prompt too, so an early "
        "output depends on later tokens: change the last token and the prompt's outputs move. "
        "The extra keys are those of the prompt, j < P, and only those.",
        DIRECT_CHECK,
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


def _prefix_visible(t, prefix):
    """[T, T] True where query i may read key j: j <= i, or j inside the prompt (j < P)."""
    return tril(t, t) | (torch.arange(t)[None, :] < prefix)


def _ref_prefix(q, k, v, prefix):
    return attend(q, k, v, _prefix_visible(q.shape[2], prefix))


def _prefix_left_causal(q, k, v, prefix):
    return attend(q, k, v, tril(q.shape[2], q.shape[2]))


def _prefix_sees_suffix(q, k, v, prefix):
    t = q.shape[2]
    return attend(q, k, v, tril(t, t) | (torch.arange(t)[:, None] < prefix))


def _prefix_cases():
    shapes = [(2, 3, 3, 7, 7, 8), (1, 2, 2, 6, 6, 4), (1, 1, 1, 5, 5, 16), (3, 2, 2, 4, 4, 8)]
    prefixes = [3, 0, 5, 1, 2]  # n = 0: causal; n = T: no mask; the spike's key lies past n
    cases = []
    for case, p in zip(qkv_cases(shapes, 5, spike=True), prefixes):
        sizes, spike, edge = case.label.partition(", one")  # n goes after the sizes
        cases.append(Case((*case.args, p), f"{sizes}, n={p}{spike}{edge}"))
    return cases


def _prefix_probe():
    (q, k, v), _ = identity_probe()
    return (q, k, v, 3), _prefix_visible(6, 3)


EXERCISES["prefix_lm_attention"] = Exercise(
    "fn(q, k, v, prefix) -> out; q, k, v [B, H, T, D], prefix P in 0..T -> [B, H, T, D]",
    "A prefix language model: query i reads key j when j <= i or j < P (the prompt is read "
    "both ways, the tokens after it are causal); scale 1/sqrt(D).",
    _prefix_cases,
    _ref_prefix,
    ("out [B, H, T, D]",),
    {"prefix_left_causal": _prefix_left_causal, "prefix_sees_suffix": _prefix_sees_suffix},
    _prefix_probe,
)
