"""Chapter 10, decoding: the bytes of a KV cache, and one decoding step against the cache."""

import torch

from ...attention import causal_attention
from ..decode import kv_cache_bytes
from .cases import f64, identity_probe, randn
from .core import Bug, Case, Exercise, Section

CHAPTER = "10_decoding"
CACHE_HOLDS = Section(CHAPTER, "10.1", "What the cache holds")

BUGS = {
    "cache_bytes_with_query_heads": Bug(
        "The count used the query heads H_q; the cache holds keys and values of the H_kv "
        "key/value heads only.",
        CACHE_HOLDS,
    ),
    "cache_bytes_keys_only": Bug(
        "Only the keys were counted; every token leaves a key and a value, hence the factor 2.",
        CACHE_HOLDS,
    ),
    "cache_not_read": Bug(
        "The new query attends only to the new key and ignores the cache, so its output is just "
        "the new value; concatenate the cached keys and values first.",
        Section("07_positions", "7.2", "Cached decoding: one query against the cache"),
    ),
}


# ---- exercise 10.1: the bytes of a KV cache -------------------------------------------------

_BYTES_DTYPES = {1: torch.int8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def _ref_cache_bytes(batch, layers, q_heads, kv_heads, head_dim, tokens, bytes_per_number):
    dtype = _BYTES_DTYPES[bytes_per_number]
    return kv_cache_bytes(tokens, layers, kv_heads, head_dim, dtype, batch)


def _with_query_heads(batch, layers, q_heads, kv_heads, head_dim, tokens, bytes_per_number):
    return _ref_cache_bytes(batch, layers, q_heads, q_heads, head_dim, tokens, bytes_per_number)


def _cache_bytes_cases():
    sizes = [(1, 28, 16, 8, 128, 32768, 2), (4, 2, 8, 2, 64, 100, 4), (2, 3, 6, 3, 16, 7, 8)]
    sizes.append((1, 1, 4, 1, 32, 1, 1))
    names = "batch layers q_heads kv_heads head_dim tokens bytes_per_number".split()
    return [Case(s, ", ".join(f"{n}={v}" for n, v in zip(names, s))) for s in sizes]


# ---- exercise 10.3: one step against the cache ----------------------------------------------


def _ref_kv(q, k, v, k_cache, v_cache):
    return causal_attention(*f64(q, torch.cat([k_cache, k], 2), torch.cat([v_cache, v], 2)))


def _cache_not_read(q, k, v, k_cache, v_cache):
    return causal_attention(*f64(q, k, v))


def _kv_cases():
    gen, cases = torch.Generator().manual_seed(3), []
    for b, h, s, d in [(2, 2, 6, 8), (1, 3, 1, 4), (1, 1, 9, 16)]:
        new = [randn(gen, b, h, 1, d) for _ in range(3)]
        cache = [randn(gen, b, h, s, d) for _ in range(2)]
        cases.append(Case((*new, *cache), f"B={b}, H={h}, S={s} cached, D={d}"))
    return cases


def _kv_probe():
    """The last token of the identity probe against the five before it, as the cache."""
    (q, k, eye), _ = identity_probe()
    q, k, eye = (torch.cat([x, x]) for x in (q, k, eye))  # B = 2
    args = (q[:, :, -1:], k[:, :, -1:], eye[:, :, -1:], k[:, :, :-1], eye[:, :, :-1])
    return args, torch.ones(1, 6, dtype=torch.bool)


EXERCISES = {
    "kv_cache_bytes": Exercise(
        "fn(batch, layers, q_heads, kv_heads, head_dim, tokens, bytes_per_number) -> bytes",
        "The bytes of a KV cache holding `tokens` tokens per sequence (eq. 10.1).",
        _cache_bytes_cases,
        _ref_cache_bytes,
        ("bytes (a number)",),
        {
            "cache_bytes_with_query_heads": _with_query_heads,
            "cache_bytes_keys_only": lambda *args: _ref_cache_bytes(*args) // 2,
        },
    ),
    "kv_cache_decode": Exercise(
        "fn(q, k, v, k_cache, v_cache) -> out; q, k, v [B, H, 1, D], caches [B, H, S, D] -> "
        "[B, H, 1, D]",
        "One decode step: the new token's query attends to the S cached keys and its own key.",
        _kv_cases,
        _ref_kv,
        ("out [B, H, 1, D]",),
        {"cache_not_read": _cache_not_read},
        _kv_probe,
    ),
}
