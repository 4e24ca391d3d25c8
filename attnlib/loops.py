"""Attention as explicit Python loops over plain lists: no tensors, no broadcasting.

One sequence: q [T][Hq*D] for the queries, k [S][Hkv*D] and v [S][Hkv*Dv] for the keys.
Query head h reads KV head h // (Hq/Hkv); query i sees key j iff pos(k_j) <= pos(q_i).
"""

import math

from .attention import check_scale


def softmax(scores):
    """Eq. 4.1 on a list, stable; an empty row stays empty."""
    if not scores:
        return []
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = sum(exps)
    return [e / total for e in exps]


def causal_attention(
    q, k, v, q_heads, kv_heads, query_positions=None, key_positions=None, scale=None
):
    """Eqs. 2.2, 5.1, 7.1 and 9.1, one query, head and key at a time.

    Returns out [T][Hq*Dv]. Default positions: keys 0..S-1, queries the last T of them.
    """
    queries, keys = len(q), len(k)
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
    if len(v) != keys:
        raise ValueError(f"k has {keys} rows but v has {len(v)}")
    dim = len(q[0]) // q_heads
    value_dim = len(v[0]) // kv_heads
    group = q_heads // kv_heads
    if query_positions is None:
        query_positions = list(range(keys - queries, keys))
    if key_positions is None:
        key_positions = list(range(keys))
    scale = check_scale(scale, dim)
    out = [[0.0] * (q_heads * value_dim) for _ in range(queries)]
    for i in range(queries):
        for h in range(q_heads):
            kv_head = h // group
            query = q[i][h * dim : (h + 1) * dim]
            seen = [j for j in range(keys) if key_positions[j] <= query_positions[i]]
            scores = []
            for j in seen:
                key = k[j][kv_head * dim : (kv_head + 1) * dim]
                scores.append(sum(a * b for a, b in zip(query, key)) * scale)
            weights = softmax(scores)
            for weight, j in zip(weights, seen):
                value = v[j][kv_head * value_dim : (kv_head + 1) * value_dim]
                for e in range(value_dim):
                    out[i][h * value_dim + e] += weight * value[e]
    return out
