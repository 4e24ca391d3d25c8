"""Decoding from a KV cache: the cache's bytes (eq. 10.1) and a step's FLOPs per byte (eq. 10.2).

Both are counted from the shapes alone, like attnlib.cost. Each layer's cache holds keys and
values [B, Hkv, S, Dh]; a decoding step runs T = 1 query per query head against all S of them.
The bytes of a step are its compulsory traffic, every tensor read or written once: a lower bound
on what a kernel moves (a tiled prefill rereads K and V once per block of queries, SDPA's
enable_gqa path reads a shared head once per query head), so eq. 10.2 is an upper bound on the
FLOPs per byte a kernel reaches.
"""

import torch

from ..cost import _count, attention_flops


def _check_groups(q_heads: int, kv_heads: int) -> None:
    """Raise ValueError unless the query heads are a multiple of the KV heads (eq. 9.1)."""
    if _count("q_heads", q_heads, 1) % _count("kv_heads", kv_heads, 1):
        raise ValueError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")


def kv_cache_bytes(
    tokens: int,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    batch: int = 1,
) -> int:
    """Bytes of a KV cache, eq. 10.1: 2 (K and V) * B * layers * Hkv * S * Dh * itemsize.

    Keys and values are [B, Hkv, S, Dh] in every layer; positions and other bookkeeping are left
    out.
    """
    _count("tokens", tokens)
    for name, value in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        _count(name, value, 1)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * _count("batch", batch, 1) * layers * kv_heads * tokens * head_dim * itemsize


def kv_intensity(
    queries: int,
    keys: int,
    head_dim: int,
    q_heads: int,
    kv_heads: int,
    dtype: torch.dtype = torch.bfloat16,
) -> float:
    """FLOPs per byte of K and V alone, when T queries [B, Hq, T, D] see all S keys.

    The limit of eq. 10.2 (step_intensity) when Q and O are left out, as they may be for T = 1.

    attention_flops over kv_cache_bytes: 4*T*S*D*Hq / (2*S*D*Hkv*itemsize) = (2T/itemsize)(Hq/Hkv).
    """
    _count("queries", queries, 1), _count("keys", keys, 1)
    _check_groups(q_heads, kv_heads)
    flops = attention_flops(queries, keys, head_dim, heads=q_heads)
    return flops / kv_cache_bytes(keys, 1, kv_heads, head_dim, dtype)


def step_bytes(
    queries: int,
    keys: int,
    head_dim: int,
    q_heads: int,
    kv_heads: int,
    dtype: torch.dtype = torch.bfloat16,
    batch: int = 1,
) -> dict:
    """Bytes one attention layer must read and write for T queries against S cached keys.

    Returns {"K", "V", "Q", "O"}: K and V are [B, Hkv, S, D] (eq. 10.1 for one layer), Q and the
    output O are [B, Hq, T, D], each counted once: the compulsory traffic, a lower bound. Their
    sum is the denominator of eq. 10.2. Scores and weights are left out: a fused kernel keeps
    them in registers and caches.
    """
    _count("queries", queries, 1), _count("keys", keys, 1), _count("head_dim", head_dim, 1)
    _check_groups(q_heads, kv_heads)
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_kv = _count("batch", batch, 1) * kv_heads * keys * head_dim * itemsize
    per_q = batch * q_heads * queries * head_dim * itemsize
    return {"K": per_kv, "V": per_kv, "Q": per_q, "O": per_q}


def step_intensity(
    queries: int,
    keys: int,
    head_dim: int,
    q_heads: int,
    kv_heads: int,
    dtype: torch.dtype = torch.bfloat16,
    causal: bool = False,
) -> float:
    """FLOPs per byte of one attention layer, eq. 10.2: attention_flops over all of K, V, Q, O,
    each moved once, so an upper bound on what a kernel that rereads a tensor reaches.

    4*T*S*D*Hq / (2*b*D*(T*Hq + S*Hkv)) = 2*T*S*Hq / (b*(T*Hq + S*Hkv)) for every pair;
    causal=True counts only the visible pairs, as a prefill kernel that skips hidden keys does.
    """
    moved = sum(step_bytes(queries, keys, head_dim, q_heads, kv_heads, dtype).values())
    flops = attention_flops(queries, keys, head_dim, heads=q_heads, causal=causal)
    return flops / moved
