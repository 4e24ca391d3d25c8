"""Chapter 13, cost: the FLOPs of attention, with and without the causal mask."""

from ...cost import attention_flops
from .core import Bug, Case, Exercise, Section

CHAPTER = "13_cost"
COUNTING = Section(CHAPTER, "13.1", "Counting the FLOPs")

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
}
