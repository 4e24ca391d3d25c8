"""What attention costs: FLOPs and bytes of eq. 2.2, counted from the shapes alone.

One query-key pair costs 2*D FLOPs for its score q.k (D multiplies, D adds) and 2*Dv for its
share of the output a_ij * v_j, so T queries against S keys cost 2*T*S*D + 2*T*S*Dv: 4*T^2*D
when S = T and Dv = D. The naive method also stores the [T, S] scores of every head.
"""

import math
import statistics

import torch


def _count(name: str, value: int, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer of at least {low}, got {value!r}")
    return value


def visible_pairs(queries: int, keys: int) -> int:
    """Query-key pairs the causal rule (eq. 7.1) keeps when the queries are the last T of S keys.

    Query i sees keys 0..S-T+i, so the count is T*S - T*(T-1)/2 (T*(T+1)/2 when T = S).
    """
    _count("queries", queries), _count("keys", keys)
    if queries > keys:
        raise ValueError(f"more queries ({queries}) than keys ({keys}): need T <= S")
    return queries * keys - queries * (queries - 1) // 2


def attention_flops(
    queries: int,
    keys: int,
    dim: int,
    value_dim=None,
    heads: int = 1,
    batch: int = 1,
    causal: bool = False,
) -> int:
    """FLOPs of the two matmuls of eq. 2.2: scores QK^T (2*T*S*D) and output AV (2*T*S*Dv).

    That is 4*T*S*D per head when Dv = D. causal=True counts only the visible pairs (what a
    kernel that skips hidden keys must do); the default counts all T*S, as the naive method does.
    """
    value_dim = dim if value_dim is None else value_dim
    for name, value in (("dim", dim), ("value_dim", value_dim), ("heads", heads), ("batch", batch)):
        _count(name, value, 1)
    pairs = visible_pairs(queries, keys) if causal else queries * keys
    return 2 * pairs * (dim + value_dim) * heads * batch


def score_matrix_bytes(
    queries: int, keys: int, dtype: torch.dtype = torch.float32, heads: int = 1, batch: int = 1
) -> int:
    """Bytes of the scores [B, H, T, S]: B*H*T*S*itemsize (256 MiB for T = S = 8192 in fp32)."""
    _count("queries", queries), _count("keys", keys), _count("heads", heads), _count("batch", batch)
    return batch * heads * queries * keys * torch.empty((), dtype=dtype).element_size()


def longest_fitting_length(
    memory_bytes: int,
    heads: int = 1,
    batch: int = 1,
    dtype: torch.dtype = torch.float32,
    copies: float = 1.0,
) -> int:
    """The largest T (= S) whose `copies` score matrices [B, H, T, T] fit in memory_bytes.

    Solves copies * B*H*T^2*itemsize <= memory_bytes for T.
    """
    if copies <= 0:
        raise ValueError(f"copies must be positive, got {copies}")
    per_entry = copies * score_matrix_bytes(1, 1, dtype, heads, batch)  # bytes per T^2
    return math.isqrt(int(memory_bytes // per_entry))  # floor(sqrt(x)) = isqrt(floor(x))


def growth_exponent(sizes, values):
    """Least-squares slope k of log(value) against log(T), so value ~ T^k; None below 2 sizes."""
    if len(set(sizes)) < 2 or min(values) <= 0:
        return None
    logs_t, logs_v = [math.log(s) for s in sizes], [math.log(v) for v in values]
    mean_t, mean_v = statistics.fmean(logs_t), statistics.fmean(logs_v)
    slope = sum((t - mean_t) * (v - mean_v) for t, v in zip(logs_t, logs_v))
    return slope / sum((t - mean_t) ** 2 for t in logs_t)
