"""Heads: splitting features into heads, multi-head attention with GQA and a KV cache.

Eqs. 2.1, 6.1 and 6.2; x is [B, T, H*Dh] before the split and [B, H, T, Dh] after it.
"""

from typing import Optional, Tuple

import torch
from torch import nn

from .attention import causal_attention


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, T, H*Dh] -> [B, H, T, Dh]: split the features into heads, then move heads forward.

    The transpose is not optional: x.reshape(B, H, T, Dh) has the same shape and the wrong data.
    """
    if x.dim() != 3:
        raise ValueError(f"split_heads needs x of shape [B, T, H*Dh], got {list(x.shape)}")
    batch, tokens, features = x.shape
    if n_heads < 1 or features % n_heads:
        raise ValueError(f"features ({features}) must be a multiple of heads ({n_heads})")
    return x.view(batch, tokens, n_heads, features // n_heads).transpose(1, 2)  # [B, H, T, Dh]


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, Dh] -> [B, T, H*Dh], the inverse of split_heads (the concatenation of eq. 6.2)."""
    if x.dim() != 4:
        raise ValueError(f"merge_heads needs x of shape [B, H, T, Dh], got {list(x.shape)}")
    batch, heads, tokens, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch, tokens, heads * head_dim)  # [B, T, H*Dh]


class KVCache:
    """The keys, values and positions seen so far: keys [B, Hkv, S, D], positions [S]."""

    def __init__(self) -> None:
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None
        self.positions: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add T new keys [B, Hkv, T, D], values and positions [T]; return everything cached."""
        if keys.shape[2] != positions.shape[-1] or values.shape[2] != keys.shape[2]:
            raise ValueError(
                f"{keys.shape[2]} keys, {values.shape[2]} values and "
                f"{positions.shape[-1]} positions must agree"
            )
        if self.keys is None:
            self.keys, self.values, self.positions = keys, values, positions
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)  # [B, Hkv, S+T, D]
            self.values = torch.cat([self.values, values], dim=2)
            self.positions = torch.cat([self.positions, positions], dim=-1)  # [S+T]
        return self.keys, self.values, self.positions


class MultiHeadAttention(nn.Module):
    """Causal multi-head attention, eqs. 6.1-6.2, with q_heads query and kv_heads KV heads.

    x [B, T, d_in] -> [B, T, d_model]. One fused projection makes all heads' q, k and v
    (eq. 2.1); heads have size d_model / q_heads; W_O mixes the concatenated heads (eq. 6.2).
    """

    def __init__(
        self, d_in: int, d_model: int, q_heads: int, kv_heads: Optional[int] = None, bias=False
    ) -> None:
        super().__init__()
        kv_heads = q_heads if kv_heads is None else kv_heads
        if q_heads < 1 or kv_heads < 1:
            raise ValueError(f"heads must be positive, got q_heads={q_heads}, kv_heads={kv_heads}")
        if d_model % q_heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of query heads ({q_heads})")
        if q_heads % kv_heads:
            raise ValueError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
        self.q_heads, self.kv_heads = q_heads, kv_heads
        self.head_dim = d_model // q_heads
        self.qkv = nn.Linear(d_in, (q_heads + 2 * kv_heads) * self.head_dim, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)  # W_O of eq. 6.2

    def forward(
        self,
        x: torch.Tensor,
        cache: Optional[KVCache] = None,
        allowed: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Attend over x [B, T, d_in], or over the cache plus x, whose tokens come next."""
        if x.dim() != 3 or x.shape[-1] != self.qkv.in_features:
            raise ValueError(f"x must be [B, T, {self.qkv.in_features}], got {list(x.shape)}")
        q_width = self.q_heads * self.head_dim
        kv_width = self.kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([q_width, kv_width, kv_width], dim=-1)  # [B, T, H*Dh] each
        q = split_heads(q, self.q_heads)  # [B, Hq, T, Dh]
        k = split_heads(k, self.kv_heads)  # [B, Hkv, T, Dh]
        v = split_heads(v, self.kv_heads)  # [B, Hkv, T, Dh]
        if cache is None:
            y = causal_attention(q, k, v, allowed=allowed)  # [B, Hq, T, Dh]
        else:
            start = len(cache)
            query_positions = torch.arange(start, start + x.shape[1], device=x.device)  # [T]
            k, v, key_positions = cache.append(k, v, query_positions)  # [B, Hkv, S, Dh], [S]
            y = causal_attention(q, k, v, query_positions, key_positions, allowed=allowed)
        return self.out_proj(merge_heads(y))  # [B, T, d_model]
