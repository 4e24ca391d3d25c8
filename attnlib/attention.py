"""Scaled dot-product attention under the positions rule (eqs. 2.2, 3.3, 5.1, 7.1, 9.1, 24.7).

Shapes are written [B, H, T, D]: batch, heads, tokens (T queries, S keys), features.
`prepare` is the preamble every attention function shares: checks, positions, mask, scale.
"""

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from .masks import check_allowed, visible
from .softmax import softmax


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError unless q [B, Hq, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] fit together."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, T, D], got shape {list(x.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(
            f"q, k and v must share a floating-point dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"head dimension of q ({q.shape[3]}) must equal that of k ({k.shape[3]})")
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(f"k {list(k.shape)} and v {list(v.shape)} need the same KV heads and keys")
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})"
        )


def check_scale(scale, dim: int) -> float:
    """The scale of eq. 3.3: 1/sqrt(D) by default, else a finite positive number."""
    if scale is None:
        return 1.0 / math.sqrt(dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a number, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite positive number, got {scale!r}")
    return float(scale)


def _positions(positions, batch: int, length: int, start: int, name: str, device) -> torch.Tensor:
    """Positions as an integer tensor [B, length]; the default is start .. start+length-1."""
    if positions is None:
        return torch.arange(start, start + length, device=device).expand(batch, length)
    positions = torch.as_tensor(positions, device=device)
    if positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got {positions.dtype}")
    if positions.dim() == 1 and positions.shape[0] == length:
        return positions.expand(batch, length)
    if positions.dim() == 2 and tuple(positions.shape) == (batch, length):
        return positions
    raise ValueError(
        f"{name} must have shape [{length}] or [{batch}, {length}], got {list(positions.shape)}"
    )


class Prepared(NamedTuple):
    """What every attention function needs once its arguments are checked."""

    query_positions: torch.Tensor  # [B, T]
    key_positions: torch.Tensor  # [B, S]
    allowed: Optional[torch.Tensor]  # [B or 1, Hq or 1, T or 1, S or 1], or None
    scale: float
    causal: bool  # False: no positions rule, every query sees every key


def prepare(
    q, k, v, query_positions=None, key_positions=None, allowed=None, scale=None, causal=True
):
    """Check q [B, Hq, T, D], k [B, Hkv, S, D], v and the options; fill in the defaults.

    By default the keys sit at 0..S-1 and the queries are the last T of them, S-T..S-1.
    """
    check_qkv(q, k, v)
    batch, q_heads, queries, dim = q.shape
    keys = k.shape[2]
    if not causal and (query_positions is not None or key_positions is not None):
        raise ValueError("positions only matter under the causal rule: drop them or causal=True")
    if causal and query_positions is None and queries > keys:
        raise ValueError(
            f"more queries ({queries}) than keys ({keys}): the default query positions "
            "S-T..S-1 need T <= S, so pass query_positions"
        )
    query_positions = _positions(
        query_positions, batch, queries, keys - queries, "query_positions", q.device
    )
    key_positions = _positions(key_positions, batch, keys, 0, "key_positions", q.device)
    if allowed is not None:
        allowed = check_allowed(allowed, (batch, q_heads, queries, keys)).to(q.device)
    return Prepared(query_positions, key_positions, allowed, check_scale(scale, dim), causal)


def mask_of(prepared: Prepared) -> Optional[torch.Tensor]:
    """The mask of eqs. 5.1/7.1, [B, 1 or Hq, T, S]: positions rule (if causal) AND `allowed`."""
    if not prepared.causal:
        return prepared.allowed
    mask = visible(prepared.query_positions, prepared.key_positions)  # [B, 1, T, S]
    return mask if prepared.allowed is None else mask & prepared.allowed


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Grouped-query attention, eq. 9.1: [B, Hkv, S, D] -> [B, Hkv*n_rep, S, D].

    Query head h then reads copy h, which is KV head h // n_rep.
    """
    if n_rep < 1:
        raise ValueError(f"n_rep must be at least 1, got {n_rep}")
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores are computed in float32; float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_sinks(sinks, q_heads: int):
    """A sink logit per query head, [Hq] (eq. 24.7), or None."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (q_heads,):
        shape = list(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"sinks must be a tensor [Hq] = [{q_heads}], one per head, got {shape}")
    return sinks


def _weights(q: torch.Tensor, k: torch.Tensor, prepared: Prepared, sinks=None) -> torch.Tensor:
    work = compute_dtype(q.dtype)
    k = repeat_kv(k, q.shape[1] // k.shape[1])  # [B, Hq, S, D]
    scores = (q.to(work) @ k.to(work).transpose(-2, -1)) * prepared.scale  # [B, Hq, T, S], eq. 3.3
    mask = mask_of(prepared)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))  # eq. 5.1: before the softmax
    if sinks is None:
        return softmax(scores, dim=-1)  # eq. 4.1
    column = sinks.to(work).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)  # [B, Hq, T, 1]
    return softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]  # eq. 24.7


def attention_weights(
    q,
    k,
    query_positions=None,
    key_positions=None,
    allowed=None,
    scale=None,
    causal=True,
    sinks=None,
):
    """The attention matrix A of eq. 2.2 under the mask of eqs. 5.1/7.1, in float32 (or 64).

    q [B, Hq, T, D], k [B, Hkv, S, D] -> A [B, Hq, T, S]; each row sums to 1, or is all zeros
    when the query sees no key. causal=False: no positions rule (bidirectional).
    sinks [Hq]: a logit per head for a column that takes weight and is dropped (eq. 24.7), so
    a row then sums to less than 1.
    """
    prepared = prepare(q, k, k, query_positions, key_positions, allowed, scale, causal)
    return _weights(q, k, prepared, check_sinks(sinks, q.shape[1]))


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_positions=None,
    key_positions=None,
    allowed: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    fused: bool = False,
    causal: bool = True,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Scaled dot-product attention, eq. 2.2, with the positions rule (7.1) and GQA (9.1).

    q [B, Hq, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] -> [B, Hq, T, Dv] in q's dtype.
    Positions are [T]/[S] or [B, T]/[B, S]; by default the queries are the last T of S keys.
    `allowed`: an optional boolean mask broadcastable to [B, Hq, T, S] (True = may attend).
    The default scale is 1/sqrt(D). A query that sees no key outputs zeros.
    causal=False drops the positions rule: every query sees every key (bidirectional).
    fused=True: PyTorch's fused kernel with the same dense [B, 1, T, S] mask (chapter 15 shows
    why that mask is itself T x S, and `causal_lower_right`, which keeps the fused kernel).
    sinks [Hq]: gpt-oss's learned sink, one logit per head whose column takes weight in the
    softmax and is dropped after it (eq. 24.7); a query may then attend to nothing.
    """
    prepared = prepare(q, k, v, query_positions, key_positions, allowed, scale, causal)
    sinks = check_sinks(sinks, q.shape[1])
    if fused and sinks is not None:
        raise ValueError("sinks need the unfused path: PyTorch's kernel has no sink column")
    if fused:  # PyTorch's kernel, given the same bottom-right mask (never is_causal: top-left)
        gqa = q.shape[1] != k.shape[1]
        mask = mask_of(prepared)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=prepared.scale, enable_gqa=gqa
        )
    weights = _weights(q, k, prepared, sinks)  # [B, Hq, T, S]
    v = repeat_kv(v, q.shape[1] // v.shape[1])  # [B, Hq, S, Dv]
    return (weights @ v.to(weights.dtype)).to(q.dtype)  # [B, Hq, T, Dv]
