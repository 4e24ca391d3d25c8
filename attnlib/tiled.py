"""Tiled attention with an online softmax, FlashAttention-style (eqs. 3.15, 3.16).

The same function as `causal_attention`, computed one [query block x key block] tile at a
time, so the [T, S] score matrix never exists: besides the output, the extra memory is one tile
of scores per head, [H, block, block], instead of [H, T, S].
"""

import math
from typing import Optional

import torch

from .attention import compute_dtype, prepare
from .masks import visible

LOG2_E = 1.0 / math.log(2.0)


def _block_bounds(positions: torch.Tensor, block: int):
    """Per block of `block` columns of positions [B, N]: (min, max) over the block, each [B, n]."""
    starts = range(0, positions.shape[1], block)
    lows = torch.stack([positions[:, s : s + block].amin(1) for s in starts], 1)  # [B, n]
    highs = torch.stack([positions[:, s : s + block].amax(1) for s in starts], 1)  # [B, n]
    return lows, highs


def _slice(mask: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    """mask[..., start:stop, ...] along dim, unless that axis is broadcast (size 1)."""
    return mask if mask.shape[dim] == 1 else mask.narrow(dim, start, stop - start)


def tiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_positions=None,
    key_positions=None,
    allowed: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    block_size: int = 256,
) -> torch.Tensor:
    """`causal_attention` (eq. 3.2 with 3.13, 3.14) by online softmax over key blocks (3.15-3.16).

    q [B, Hq, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] -> [B, Hq, T, Dv] in q's dtype, with the
    arguments of `causal_attention`. Tiles are block_size queries by block_size keys; tiles
    that no query can see are skipped.
    """
    query_pos, key_pos, allowed, scale = prepare(
        q, k, v, query_positions, key_positions, allowed, scale
    )
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer of at least 1, got {block_size!r}")
    batch, q_heads, queries, dim = q.shape
    kv_heads, keys, value_dim = k.shape[1], k.shape[2], v.shape[3]
    group = q_heads // kv_heads  # eq. 3.14: query head h = kv_head * group + r
    out_dtype, work = q.dtype, compute_dtype(q.dtype)
    # Query heads grouped under their KV head (eq. 3.14), so one matmul serves the whole group.
    q = q.reshape(batch, kv_heads, group, queries, dim)  # [B, Hkv, g, T, D]
    k, v = k.to(work), v.to(work)  # [B, Hkv, S, D], [B, Hkv, S, Dv]
    out = torch.zeros(batch, kv_heads, group, queries, value_dim, dtype=work, device=q.device)
    if queries == 0 or keys == 0:  # nothing to attend: every row is a row that sees no key
        return out.view(batch, q_heads, queries, value_dim).to(out_dtype)

    # Tiles the positions rule (3.13) hides entirely are skipped; tiles it shows need no mask.
    q_low, q_high = _block_bounds(query_pos, block_size)  # [B, nq]
    k_low, k_high = _block_bounds(key_pos, block_size)  # [B, nk]
    hidden = (k_low[:, None, :] > q_high[:, :, None]).all(0).tolist()  # [nq][nk]
    shown = (k_high[:, None, :] <= q_low[:, :, None]).all(0).tolist()  # [nq][nk]

    for qi, i0 in enumerate(range(0, queries, block_size)):
        i1 = min(i0 + block_size, queries)
        rows = group * (i1 - i0)  # the tile's query rows, all heads of a group stacked
        # Scores in base 2: e^s = 2^(s * log2 e), and exp2 is several times cheaper than exp.
        q_tile = (q[:, :, :, i0:i1].to(work) * (scale * LOG2_E)).reshape(batch, kv_heads, rows, dim)
        best = q_tile.new_full((batch, kv_heads, rows, 1), float("-inf"))  # running max m
        total = q_tile.new_zeros(batch, kv_heads, rows, 1)  # running sum l
        acc = q_tile.new_zeros(batch, kv_heads, rows, value_dim)  # accumulator o
        allowed_rows = None if allowed is None else _slice(allowed, -2, i0, i1)
        for kj, j0 in enumerate(range(0, keys, block_size)):
            if hidden[qi][kj]:
                continue
            j1 = min(j0 + block_size, keys)
            mask = None if shown[qi][kj] else visible(query_pos[:, i0:i1], key_pos[:, j0:j1])
            if allowed_rows is not None:
                extra = _slice(allowed_rows, -1, j0, j1)  # broadcasts to [B, Hq, t, s]
                if not bool(extra.any()):
                    continue
                if not bool(extra.all()):
                    mask = extra if mask is None else mask & extra
            scores = q_tile @ k[:, :, j0:j1].transpose(-2, -1)  # [B, Hkv, g*t, s], eq. 3.5
            if mask is not None:  # [B or 1, Hq or 1, t or 1, s or 1], heads split like scores
                b, h, t, s = mask.shape
                mask = mask.reshape(b, *((1, 1) if h == 1 else (kv_heads, group)), t, s)
                scores.view(batch, kv_heads, group, i1 - i0, j1 - j0).masked_fill_(~mask, -math.inf)
            new_best = torch.maximum(best, scores.amax(-1, keepdim=True))  # eq. 3.15: m'
            # A row that has seen no key yet keeps m' = -inf; shift it by 0 so exp gives 0, not NaN.
            shift = new_best.masked_fill(torch.isneginf(new_best), 0.0)
            rescale = torch.exp2(best - shift)  # e^{m - m'} (the scores carry the log2 e)
            weights = scores.sub_(shift).exp2_()  # e^{s_j - m'}
            total.mul_(rescale).add_(weights.sum(-1, keepdim=True))  # eq. 3.15: l'
            acc.mul_(rescale).add_(weights @ v[:, :, j0:j1])  # eq. 3.16: o'
            best = new_best
        acc /= total.masked_fill(total == 0, 1.0)  # o / l; a row that saw nothing stays 0
        out[:, :, :, i0:i1] = acc.view(batch, kv_heads, group, i1 - i0, value_dim)
    return out.view(batch, q_heads, queries, value_dim).to(out_dtype)  # [B, Hq, T, Dv]
