"""Independent references the tests compare attnlib against."""

import math

import torch
import torch.nn.functional as F


def bottom_right_mask(query_positions, key_positions, allowed=None):
    """Boolean [B, 1 or H, T, S] mask for SDPA (True = attend), built from positions directly."""
    mask = key_positions[:, None, None, :] <= query_positions[:, None, :, None]
    return mask if allowed is None else mask & allowed


def sdpa(q, k, v, mask, scale=None):
    """PyTorch's fused attention with an explicit mask and GQA."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def brute_force(q, k, v, query_positions, key_positions, allowed=None, scale=None):
    """float64 attention, one query, head and key at a time, from the definitions alone.

    Shapes: q [B, Hq, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv], positions [B, T] and [B, S],
    allowed broadcastable to [B, Hq, T, S] or None.
    """
    q, k, v = q.double(), k.double(), v.double()
    batch, q_heads, queries, dim = q.shape
    kv_heads, keys, value_dim = k.shape[1], k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    if allowed is not None:
        allowed = allowed.expand(batch, q_heads, queries, keys)
    out = torch.zeros(batch, q_heads, queries, value_dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(q_heads):
            g = h // (q_heads // kv_heads)
            for i in range(queries):
                seen = [
                    j
                    for j in range(keys)
                    if key_positions[b, j] <= query_positions[b, i]
                    and (allowed is None or bool(allowed[b, h, i, j]))
                ]
                if not seen:
                    continue
                scores = [float(q[b, h, i] @ k[b, g, j]) * scale for j in seen]
                top = max(scores)
                exps = [math.exp(s - top) for s in scores]
                total = sum(exps)
                for e, j in zip(exps, seen):
                    out[b, h, i] += e / total * v[b, g, j]
    return out
