"""Rotary position embeddings (RoPE) in the rotate-half convention, eq. 3.17.

Feature i of a head is paired with feature i + D/2; the pair at position p is turned by the
angle p * theta**(-2i/D). Shapes: x [B, H, T, D], cos and sin [T, D] or [B, T, D].
"""

import torch


def rope_frequencies(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """The angle per position of each feature pair, theta**(-2i/D) for i < D/2: shape [D/2]."""
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"RoPE needs an even head dimension of at least 2, got {head_dim}")
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def rope_cos_sin(positions, head_dim: int, theta: float = 10000.0):
    """cos and sin of eq. 3.17 for positions [T] or [B, T]: each [T, D] or [B, T, D], float32.

    The D/2 angles are repeated, cat(angles, angles), so feature i and i + D/2 share one angle.
    """
    positions = torch.as_tensor(positions)
    if positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise ValueError(f"positions must hold integers, got {positions.dtype}")
    if positions.dim() not in (1, 2):
        raise ValueError(f"positions must be [T] or [B, T], got shape {list(positions.shape)}")
    inv_freq = rope_frequencies(head_dim, theta).to(positions.device)  # [D/2]
    angles = positions[..., None].float() * inv_freq  # [..., T, D/2]
    angles = torch.cat((angles, angles), dim=-1)  # [..., T, D]
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last axis: the 90-degree turn of eq. 3.17."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Eq. 3.17, x' = x cos + rotate_half(x) sin: x [B, H, T, D], cos and sin [T, D] or [B, T, D]

    cos and sin are cast to x's dtype first, as Hugging Face does.
    """
    if x.dim() != 4:
        raise ValueError(f"x must be [B, H, T, D], got shape {list(x.shape)}")
    if cos.shape != sin.shape or cos.dim() not in (2, 3) or cos.shape[-2:] != x.shape[-2:]:
        raise ValueError(
            f"cos {list(cos.shape)} and sin {list(sin.shape)} must both be [T, D] or [B, T, D] "
            f"with T, D = {list(x.shape[-2:])}"
        )
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, D]: the same angles for every head
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin  # [B, H, T, D]
