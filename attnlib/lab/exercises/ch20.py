"""Chapter 20, ring attention: causal attention shard by shard of the keys, merged."""

import math

import torch

from ...merge import merge_attention
from ...softmax import softmax
from .cases import f64, randn, tril
from .core import Bug, Case, Exercise, Section

CHAPTER = "20_ring_attention"
THE_RING = Section(CHAPTER, "20.1", "The ring")

BUGS = {
    "ring_partials_averaged": Bug(
        "The shards' partial outputs were averaged; merge them with their log-sum-exps "
        "(eq. 19.1), so that each shard counts with its share of the softmax.",
        THE_RING,
    ),
    "ring_empty_shard_nan": Bug(
        "A shard wholly in a query's future makes a softmax over a row of -inf, NaN, and NaN "
        "times the weight 0 is still NaN: such a partial must be 0 with L = -inf.",
        THE_RING,
    ),
}


def _shard_partials(q, k, v, processes, torch_softmax=False):
    """Per contiguous shard of the keys: (out, lse) of every query over that shard (causal)."""
    q, k, v = f64(q, k, v)
    t, size = q.shape[2], q.shape[2] // processes
    parts = []
    for j0 in range(0, t, size):
        visible = tril(t, t)[:, j0 : j0 + size]  # [T, size]
        scores = (q @ k[:, :, j0 : j0 + size].transpose(-2, -1)) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~visible, -math.inf)
        weights = torch.softmax(scores, -1) if torch_softmax else softmax(scores)
        parts.append((weights @ v[:, :, j0 : j0 + size], scores.logsumexp(-1)))
    return parts


def _ring(q, k, v, processes, torch_softmax=False):
    parts = _shard_partials(q, k, v, processes, torch_softmax)
    out, lse = parts[0]
    for part in parts[1:]:
        out, lse = merge_attention(out, lse, *part)
    return out


def _averaged(q, k, v, processes):
    parts = _shard_partials(q, k, v, processes)
    seen = torch.stack([torch.isfinite(lse) for _, lse in parts]).double().sum(0)  # [B, H, T]
    return sum(out for out, _ in parts) / seen[..., None]


def _cases():
    gen, cases = torch.Generator().manual_seed(21), []
    for b, h, t, d, processes in [
        (1, 2, 8, 4, 2),
        (2, 1, 12, 8, 3),
        (1, 2, 8, 4, 4),
        (1, 1, 6, 4, 1),
    ]:
        q, k, v = (randn(gen, b, h, t, d) for _ in range(3))
        cases.append(Case((q, k, v, processes), f"B={b}, H={h}, T={t}, D={d}, P={processes}"))
    return cases


EXERCISES = {
    "ring_attention_simulated": Exercise(
        "fn(q, k, v, processes) -> out; q, k, v [B, H, T, D], T a multiple of processes",
        "Causal attention computed shard by shard: the keys in `processes` contiguous shards, "
        "each shard's partial (out, L) for every query, merged.",
        _cases,
        _ring,
        ("out [B, H, T, D]",),
        {
            "ring_partials_averaged": _averaged,
            "ring_empty_shard_nan": lambda q, k, v, p: _ring(q, k, v, p, torch_softmax=True),
        },
    ),
}
