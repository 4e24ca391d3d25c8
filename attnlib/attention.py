"""Scaled dot-product attention under the positions rule (eqs. 3.2, 3.10, 3.13, 3.14).

Shapes are written [B, H, T, D]: batch, heads, tokens (T queries, S keys), features.
"""

import math
from typing import Optional, Tuple

import torch

from .softmax import softmax


def _shape(x) -> list:
    return list(x.shape)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError unless q [B, Hq, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] fit together."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, T, D], got shape {_shape(x)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if not q.dtype.is_floating_point:
        raise ValueError(f"q, k and v must be floating point, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}"
        )
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(
            f"batch sizes differ: q has {q.shape[0]}, k has {k.shape[0]}, v has {v.shape[0]}"
        )
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"head dimension of q ({q.shape[3]}) must equal that of k ({k.shape[3]})")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(
            f"k {_shape(k)} and v {_shape(v)} must have the same KV heads and keys [B, Hkv, S, *]"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})"
        )


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
        f"{name} must have shape [{length}] or [{batch}, {length}], got {_shape(positions)}"
    )


def resolve_positions(
    query_positions, key_positions, batch: int, queries: int, keys: int, device
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Query positions [B, T] and key positions [B, S], filling the defaults.

    By default the keys sit at 0..S-1 and the queries are the last T of them, S-T..S-1.
    """
    if query_positions is None and queries > keys:
        raise ValueError(
            f"more queries ({queries}) than keys ({keys}): the default query positions "
            "S-T..S-1 need T <= S, so pass query_positions"
        )
    query_pos = _positions(
        query_positions, batch, queries, keys - queries, "query_positions", device
    )
    key_pos = _positions(key_positions, batch, keys, 0, "key_positions", device)
    return query_pos, key_pos


def check_allowed(allowed, target: Tuple[int, int, int, int]) -> torch.Tensor:
    """Check that the boolean mask `allowed` broadcasts to target [B, Hq, T, S] and return it."""
    if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool:
        kind = allowed.dtype if isinstance(allowed, torch.Tensor) else type(allowed).__name__
        raise ValueError(f"allowed must be a boolean tensor (True = may attend), got {kind}")
    # Broadcasting to target means: no more axes than target, and each axis is 1 or equal.
    # (Written out: torch.broadcast_shapes imports sympy, half a second on first use.)
    axes = tuple(allowed.shape)
    fits = len(axes) <= len(target) and all(
        size in (1, want) for size, want in zip(reversed(axes), reversed(target))
    )
    if not fits:
        raise ValueError(
            f"allowed of shape {_shape(allowed)} cannot broadcast to [B, Hq, T, S] = {list(target)}"
        )
    return allowed


def visible(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """The positions rule, eq. 3.13: key j is visible to query i iff pos(k_j) <= pos(q_i).

    query_positions [B, T], key_positions [B, S] -> boolean [B, 1, T, S] (broadcasts over heads).
    """
    return key_positions[:, None, None, :] <= query_positions[:, None, :, None]


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Grouped-query attention, eq. 3.14: [B, Hkv, S, D] -> [B, Hkv*n_rep, S, D].

    Query head h then reads copy h, which is KV head h // n_rep.
    """
    if n_rep < 1:
        raise ValueError(f"n_rep must be at least 1, got {n_rep}")
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores are computed in float32; float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    query_positions=None,
    key_positions=None,
    allowed: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """The attention matrix A of eq. 3.2 under the mask of eqs. 3.10/3.13, in float32 (or float64).

    q [B, Hq, T, D], k [B, Hkv, S, D] -> A [B, Hq, T, S]; each row sums to 1, or is all zeros
    when the query sees no key.
    """
    check_qkv(q, k, k)
    batch, q_heads, queries, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    query_pos, key_pos = resolve_positions(
        query_positions, key_positions, batch, queries, keys, q.device
    )
    mask = visible(query_pos, key_pos)  # [B, 1, T, S]
    if allowed is not None:
        mask = mask & check_allowed(allowed, (batch, q_heads, queries, keys)).to(q.device)
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    work = compute_dtype(q.dtype)
    k = repeat_kv(k, q_heads // kv_heads)  # [B, Hq, S, D]
    scores = (q.to(work) @ k.to(work).transpose(-2, -1)) * scale  # [B, Hq, T, S], eq. 3.5
    scores = scores.masked_fill(~mask, float("-inf"))  # eq. 3.10: mask *before* the softmax
    return softmax(scores, dim=-1)  # eq. 3.6


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_positions=None,
    key_positions=None,
    allowed: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Scaled dot-product attention, eq. 3.2, with the positions rule (3.13) and GQA (3.14).

    q [B, Hq, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] -> [B, Hq, T, Dv] in q's dtype.
    Positions are [T]/[S] or [B, T]/[B, S]; by default the queries are the last T of S keys.
    `allowed` is an optional boolean mask broadcastable to [B, Hq, T, S] (True = may attend).
    The default scale is 1/sqrt(D). A query that sees no key outputs zeros.
    """
    check_qkv(q, k, v)
    weights = attention_weights(q, k, query_positions, key_positions, allowed, scale)
    v = repeat_kv(v, q.shape[1] // v.shape[1])  # [B, Hq, S, Dv]
    return (weights @ v.to(weights.dtype)).to(q.dtype)  # [B, Hq, T, Dv]


def sliding_window(query_positions, key_positions, window: int) -> torch.Tensor:
    """The `allowed` mask of a window: query i may see key j iff pos(q_i) - pos(k_j) < window.

    Together with the causal rule each query sees only its last `window` keys (itself included).
    Positions [T] and [S] give [T, S]; positions with a batch axis give [B, 1, T, S].
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer of at least 1, got {window!r}")
    query_positions = torch.as_tensor(query_positions)
    key_positions = torch.as_tensor(key_positions, device=query_positions.device)
    if query_positions.dim() == 1 and key_positions.dim() == 1:
        return query_positions[:, None] - key_positions[None, :] < window  # [T, S]
    if query_positions.dim() > 2 or key_positions.dim() > 2:
        raise ValueError(
            f"positions must be [T] or [B, T], got {_shape(query_positions)} and "
            f"{_shape(key_positions)}"
        )
    query_positions = query_positions.reshape(-1, query_positions.shape[-1])  # [B or 1, T]
    key_positions = key_positions.reshape(-1, key_positions.shape[-1])  # [B or 1, S]
    return query_positions[:, None, :, None] - key_positions[:, None, None, :] < window


def left_padding(lengths, total: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Positions and key mask for a left-padded batch of sequences with the given lengths.

    Row b holds total - lengths[b] pad slots, then its tokens at positions 0..lengths[b]-1.
    Returns positions [B, total] (pads get negative positions) and allowed [B, 1, 1, total],
    False on the pads, so no query reads a pad and a pad query sees nothing (zero output).
    """
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1 or bool((lengths < 0).any()) or bool((lengths > total).any()):
        raise ValueError(f"lengths must be a list of sizes in 0..{total}, got {lengths.tolist()}")
    slots = torch.arange(total)
    positions = slots[None, :] - (total - lengths)[:, None]  # [B, total]
    return positions, (positions >= 0)[:, None, None, :]


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, T, H*Dh] -> [B, H, T, Dh]: split the features into heads, then move heads forward.

    The transpose is not optional: x.reshape(B, H, T, Dh) has the same shape and the wrong data.
    """
    if x.dim() != 3:
        raise ValueError(f"split_heads needs x of shape [B, T, H*Dh], got {_shape(x)}")
    batch, tokens, features = x.shape
    if n_heads < 1 or features % n_heads:
        raise ValueError(f"features ({features}) must be a multiple of heads ({n_heads})")
    return x.view(batch, tokens, n_heads, features // n_heads).transpose(1, 2)  # [B, H, T, Dh]


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, Dh] -> [B, T, H*Dh], the inverse of split_heads (the concatenation of eq. 3.12)."""
    if x.dim() != 4:
        raise ValueError(f"merge_heads needs x of shape [B, H, T, Dh], got {_shape(x)}")
    batch, heads, tokens, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch, tokens, heads * head_dim)  # [B, T, H*Dh]
