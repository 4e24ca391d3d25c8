"""Chapter 13, cost: the FLOPs of attention, with and without the causal mask, and under a
sliding window."""

from ...cost import attention_flops
from .core import Bug, Case, Exercise, Section

CHAPTER = "13_cost"
COUNTING = Section(CHAPTER, "13.1", "Counting the FLOPs")
WINDOWS = Section("07_positions", "7.5", "Sliding windows through `allowed`")

BUGS = {
    "flops_one_product": Bug(
        "Only the scores Q K^T were counted; the output A V is a second product of the same "
        "size, 2 T S D_v more.",
        COUNTING,
    ),
    "flops_causal_half": Bug(
        "The causal count took half the pairs, T S / 2; query i sees S - T + i + 1 keys, so the "
        "visible pairs number T S - T (T - 1) / 2.",
        COUNTING,
    ),
    "window_flops_full_width": Bug(
        "Every query was credited with w keys; the query at position p has only p + 1 keys at or "
        "before it, so the queries at positions below w - 1 see fewer (a window as wide as the "
        "sequence leaves the causal triangle).",
        WINDOWS,
    ),
    "window_flops_one_too_wide": Bug(
        "The window kept w + 1 keys: query i sees key j while pos(q_i) - pos(k_j) < w, so the key "
        "at distance w is already outside (a window of 1 keeps only the query's own key).",
        WINDOWS,
    ),
    "window_flops_no_window": Bug(
        "The window was left out and this is the causal count: the window is a second condition, "
        "joined to the causal rule by a logical and, so a query sees at most its last w keys.",
        WINDOWS,
    ),
}


def _reference(batch, heads, queries, keys, head_dim, causal):
    return attention_flops(queries, keys, head_dim, heads=heads, batch=batch, causal=causal)


def _causal_half(batch, heads, queries, keys, head_dim, causal):
    pairs = queries * keys / 2 if causal else queries * keys
    return 4 * pairs * head_dim * heads * batch


def _cases():
    sizes = [(1, 8, 8192, 8192, 64, False), (2, 4, 16, 16, 32, True), (1, 2, 3, 10, 8, True)]
    sizes.append((3, 1, 5, 5, 4, False))
    names = "batch heads queries keys head_dim causal".split()
    return [Case(s, ", ".join(f"{n}={v}" for n, v in zip(names, s))) for s in sizes]


def _window_pairs(queries, keys, window):
    """Pairs the causal rule and a window of `window` keys allow, T queries at the end of S
    keys: query i, at position S - T + i, sees min(S - T + i + 1, w) keys (eq. 7.1, window)."""
    return sum(min(keys - queries + i + 1, window) for i in range(queries))


def _window_reference(queries, keys, head_dim, window):
    return 4 * head_dim * _window_pairs(queries, keys, window)


def _window_cases():
    sizes = [
        ((1, 4096, 64, 256), ", a decoding query"),
        ((16, 16, 8, 4), ""),
        ((100, 130, 16, 40), ", after 30 cached keys"),
        ((8, 8, 4, 100), ", window wider than S"),
        ((5, 12, 32, 1), ""),
        ((512, 512, 64, 512), ", window = S"),
    ]
    label = "T={}, S={}, D={}, w={}{}"
    return [Case(s, label.format(*s, what)) for s, what in sizes]


EXERCISES = {
    "attention_flops": Exercise(
        "fn(batch, heads, queries, keys, head_dim, causal) -> flops",
        "The FLOPs of the two products of eq. 2.2 (D_v = D); causal counts only the pairs that "
        "query i, at position keys - queries + i, may see.",
        _cases,
        _reference,
        ("flops (a number)",),
        {
            "flops_one_product": lambda *args: _reference(*args) // 2,
            "flops_causal_half": _causal_half,
        },
    ),
    "window_flops": Exercise(
        "fn(queries, keys, head_dim, window) -> flops",
        "The FLOPs of QK^T and AV for one head (D_v = D) over the pairs that the causal rule and "
        "a window of `window` keys allow; the queries are the last of the keys.",
        _window_cases,
        _window_reference,
        ("flops (a number)",),
        {
            "window_flops_full_width": lambda t, s, d, w: 4 * d * t * w,
            "window_flops_one_too_wide": lambda t, s, d, w: _window_reference(t, s, d, w + 1),
            "window_flops_no_window": lambda t, s, d, w: _window_reference(t, s, d, s),
        },
    ),
}
