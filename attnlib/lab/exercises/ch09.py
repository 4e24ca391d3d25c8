"""Chapter 9, grouped-query attention: query head h reads key/value head h // g, and a
multi-head layer's keys and values pooled into groups."""

import torch

from .cases import attend, f64, identity_probe, qkv_cases, randn, ref_causal, tril
from .core import Bug, Case, Exercise, Section

CHAPTER = "09_grouped_query"
REPEAT_KV = Section(CHAPTER, "9.2", "Repeating the key/value heads")

BUGS = {
    "repeat_not_interleave": Bug(
        "k.repeat(1, g, 1, 1) tiles the KV heads (0, 1, 0, 1); query head h needs KV head h // g, "
        "which repeat_interleave(g, dim=1) gives (0, 0, 1, 1).",
        REPEAT_KV,
    ),
    "pool_kv_strided": Bug(
        "Each group was pooled from heads taken at a stride, g, g + Hkv, g + 2 Hkv, ...: the "
        "tiled layout. Eq. 9.1's groups are consecutive: KV head g serves the G query heads "
        "from gG on, so reshape the heads to [Hkv, G] and average over G.",
        REPEAT_KV,
    ),
    "pool_kv_summed": Bug(
        "The heads of a group were summed, not averaged: keys G times too large make every "
        "score G times larger and the softmax sharper, and values G times too large scale the "
        "output by G. Divide by G, the heads per group.",
        Section("03_scaling", "3.3", r"Why $\sqrt{d}$, and not $d$ or nothing"),
    ),
}


def _repeat_not_interleave(q, k, v):
    g = q.shape[1] // k.shape[1]
    t = q.shape[2]
    return attend(q, k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1), tril(t, t))


def _cases():
    shapes = [(2, 4, 2, 5, 5, 8), (1, 6, 3, 6, 6, 4), (1, 6, 2, 4, 4, 8), (1, 2, 2, 3, 3, 4)]
    return qkv_cases(shapes, 4)


# ---- exercise 9.2: from multi-head to grouped, by averaging ----------------------------------


def _pool(k, v, kv_heads, strided=False, summed=False):
    """(k, v) [B, H, S, D] -> each [B, Hkv, S, D], the mean of every group of eq. 9.1."""
    out = []
    for x in f64(k, v):
        b, h, s, d = x.shape
        if strided:  # group g = heads g, g + Hkv, ...
            x = x.reshape(b, h // kv_heads, kv_heads, s, d).transpose(1, 2)
        else:
            x = x.reshape(b, kv_heads, h // kv_heads, s, d)
        out.append(x.sum(2) if summed else x.mean(2))
    return tuple(out)


def _pool_cases():
    gen, cases = torch.Generator().manual_seed(24), []
    for b, h, s, d, kv_heads in [
        (2, 4, 5, 8, 2),
        (1, 6, 4, 4, 3),
        (1, 6, 3, 4, 2),
        (1, 8, 3, 2, 1),
        (1, 4, 4, 4, 4),
    ]:
        k, v = randn(gen, b, h, s, d), randn(gen, b, h, s, d)
        cases.append(Case((k, v, kv_heads), f"B={b}, H={h}, S={s}, D={d}, Hkv={kv_heads}"))
    return cases


EXERCISES = {
    "grouped_query_attention": Exercise(
        "fn(q, k, v) -> out; q [B, Hq, T, D], k and v [B, Hkv, T, D] -> [B, Hq, T, D]",
        "Causal attention where query head h reads KV head h // (Hq / Hkv).",
        _cases,
        ref_causal,
        ("out [B, Hq, T, D]",),
        {"repeat_not_interleave": _repeat_not_interleave},
        lambda: identity_probe(hq=4),
    ),
    "pool_kv_heads": Exercise(
        "fn(k, v, kv_heads) -> (k_pooled, v_pooled); k, v [B, H, S, D] -> each [B, Hkv, S, D]",
        "Multi-head to grouped-query: KV head g is the mean of the heads gG .. (g+1)G - 1 "
        "(eq. 9.1), G = H / Hkv.",
        _pool_cases,
        _pool,
        ("k_pooled [B, Hkv, S, D]", "v_pooled [B, Hkv, S, D]"),
        {
            "pool_kv_strided": lambda k, v, n: _pool(k, v, n, strided=True),
            "pool_kv_summed": lambda k, v, n: _pool(k, v, n, summed=True),
        },
    ),
}
