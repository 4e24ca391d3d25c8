"""ALiBi, chapter 24: a linear bias on the scores in place of a rotation (eqs. 24.5-24.6).

Head h adds -slope_h * (pos(q_i) - pos(k_j)) to score z_ij (eq. 24.5): the further back a key,
the lower its score, a soft version of the causal mask of eq. 5.1. The slopes are a geometric
sequence, 2**(-8h/H) for h = 1..H when H is a power of two; otherwise the H' = 2**floor(log2 H)
slopes of H' heads, then every other slope of 2H' heads (eq. 24.6). Shapes as in attention.py.
"""

import math

import torch

from .attention import compute_dtype, mask_of, prepare, repeat_kv
from .softmax import softmax


def _power_slopes(heads: int) -> list:
    """2**(-8h/H) for h = 1..H, H a power of two: the ratio is 2**(-8/H)."""
    return [2.0 ** (-8.0 * h / heads) for h in range(1, heads + 1)]


def alibi_slopes(heads: int) -> torch.Tensor:
    """Eq. 24.6: the slope of each of `heads` heads, [H] float32, largest first."""
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ValueError(f"the number of heads must be a positive integer, got {heads!r}")
    power = 2 ** math.floor(math.log2(heads))
    slopes = _power_slopes(power)
    if power != heads:  # the odd-numbered slopes of twice as many heads fill the rest
        slopes += _power_slopes(2 * power)[0::2][: heads - power]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: torch.Tensor, query_positions, key_positions) -> torch.Tensor:
    """Eq. 24.5: -slope_h * (pos(q_i) - pos(k_j)), from positions [B, T] and [B, S]:
    [B, H, T, S] float32. Keys ahead of a query get a positive bias; the mask removes them."""
    query_positions = torch.as_tensor(query_positions)
    key_positions = torch.as_tensor(key_positions)
    distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]  # [B,1,T,S]
    return -slopes.float().view(1, -1, 1, 1) * distance.float()


def alibi_attention(
    q, k, v, slopes, query_positions=None, key_positions=None, allowed=None, scale=None
) -> torch.Tensor:
    """Causal attention (eqs. 2.2, 5.1, 7.1, 9.1) with ALiBi's bias added to the scores
    (eq. 24.5), the distance measured by the positions rule's own positions.

    q [B, Hq, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv], slopes [Hq] -> [B, Hq, T, Dv].
    """
    prepared = prepare(q, k, v, query_positions, key_positions, allowed, scale, True)
    if slopes.shape != (q.shape[1],):
        raise ValueError(f"slopes must be [Hq] = [{q.shape[1]}], got {list(slopes.shape)}")
    work = compute_dtype(q.dtype)
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # [B, Hq, S, D]
    scores = (q.to(work) @ k.to(work).transpose(-2, -1)) * prepared.scale  # [B, Hq, T, S]
    bias = alibi_bias(slopes, prepared.query_positions, prepared.key_positions)
    scores = scores + bias.to(work)  # eq. 24.5
    scores = scores.masked_fill(~mask_of(prepared), float("-inf"))  # eq. 5.1
    weights = softmax(scores, dim=-1)  # eq. 4.1
    return (weights @ v.to(work)).to(q.dtype)  # [B, Hq, T, Dv]
