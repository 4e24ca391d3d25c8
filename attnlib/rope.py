"""Rotary position embeddings (RoPE), derived in chapter 8: the rotate-half layout, eq. 8.4.

Feature i of a head pairs with feature i + D/2, turned at position p by p * theta**(-2i/D)
radians (eqs. 8.3-8.5). Shapes: x [B, H, T, D], cos and sin [T, D] or [B, T, D].
"""

import torch


def rope_frequencies(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Eq. 8.3: the angle per position of each feature pair, theta**(-2i/D) for i < D/2: [D/2]."""
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"RoPE needs an even head dimension of at least 2, got {head_dim}")
    if not theta > 0:
        raise ValueError(f"the RoPE base theta must be positive (often 1e4 or 1e6), got {theta}")
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def rope_cos_sin(positions, head_dim: int, theta: float = 10000.0):
    """cos and sin of eq. 8.4 for integer positions [T] or [B, T]: [T, D] or [B, T, D], float32."""
    positions = torch.as_tensor(positions)
    if positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise ValueError(f"positions must hold integers, got {positions.dtype}")
    if positions.dim() not in (1, 2):
        raise ValueError(f"positions must be [T] or [B, T], got shape {list(positions.shape)}")
    inv_freq = rope_frequencies(head_dim, theta).to(positions.device)  # [D/2]
    angles = positions[..., None].float() * inv_freq  # [..., T, D/2]
    angles = torch.cat((angles, angles), dim=-1)  # [..., T, D]: features i and i + D/2 share one
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last axis: the 90-degree turn of eq. 8.4."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Eq. 8.4, x cos + rotate_half(x) sin: x [B, H, T, D], cos and sin [T, D] or [B, T, D].

    cos and sin are cast to x's dtype first, as Hugging Face does."""
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"x must be [B, H, T, D] with an even D, got shape {list(x.shape)}")
    batch, _, *tail = x.shape  # tail = [T, D]
    if cos.shape != sin.shape or list(cos.shape) not in (tail, [1, *tail], [batch, *tail]):
        raise ValueError(
            f"cos {list(cos.shape)} and sin {list(sin.shape)} must both be [T, D] or [B, T, D] "
            f"with B, T, D = {[batch, *tail]}: one position per token"
        )
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, D]: the same angles for every head
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin  # [B, H, T, D]
