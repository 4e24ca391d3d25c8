"""Chapter 9, grouped-query attention: query head h reads key/value head h // g."""

from .cases import attend, identity_probe, qkv_cases, ref_causal, tril
from .core import Bug, Exercise, Section

CHAPTER = "09_grouped_query"

BUGS = {
    "repeat_not_interleave": Bug(
        "k.repeat(1, g, 1, 1) tiles the KV heads (0, 1, 0, 1); query head h needs KV head h // g, "
        "which repeat_interleave(g, dim=1) gives (0, 0, 1, 1).",
        Section(CHAPTER, "9.2", "Repeating the key/value heads"),
    ),
}


def _repeat_not_interleave(q, k, v):
    g = q.shape[1] // k.shape[1]
    t = q.shape[2]
    return attend(q, k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1), tril(t, t))


def _cases():
    shapes = [(2, 4, 2, 5, 5, 8), (1, 6, 3, 6, 6, 4), (1, 6, 2, 4, 4, 8), (1, 2, 2, 3, 3, 4)]
    return qkv_cases(shapes, 4)


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
}
