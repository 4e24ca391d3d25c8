"""Who may attend to whom: the positions rule (eq. 7.1), windows, padding and `allowed` masks.

Masks are boolean, True meaning "may attend", shaped to broadcast to [B, Hq, T, S].
"""

from typing import Tuple

import torch


def visible(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """The positions rule, eq. 7.1: key j is visible to query i iff pos(k_j) <= pos(q_i).

    query_positions [B, T], key_positions [B, S] -> boolean [B, 1, T, S] (broadcasts over heads).
    """
    return key_positions[:, None, None, :] <= query_positions[:, None, :, None]


def check_allowed(allowed, target: Tuple[int, int, int, int]) -> torch.Tensor:
    """Check that the boolean mask `allowed` broadcasts to target [B, Hq, T, S]; return it 4-D."""
    if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool:
        kind = allowed.dtype if isinstance(allowed, torch.Tensor) else type(allowed).__name__
        raise ValueError(f"allowed must be a boolean tensor (True = may attend), got {kind}")
    # Written out: torch.broadcast_shapes imports sympy, half a second on first use.
    axes = tuple(allowed.shape)
    fits = len(axes) <= 4 and all(size in (1, want) for size, want in zip(axes[::-1], target[::-1]))
    if not fits:
        raise ValueError(
            f"allowed of shape {list(axes)} cannot broadcast to [B, Hq, T, S] = {list(target)}"
        )
    return allowed.reshape((1,) * (4 - len(axes)) + axes)  # [B or 1, Hq or 1, T or 1, S or 1]


def check_window(window) -> None:
    """Raise ValueError unless `window` (of `sliding_window`) is an integer of at least 1."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer of at least 1, got {window!r}")


def sliding_window(query_positions, key_positions, window: int) -> torch.Tensor:
    """The `allowed` mask of a window: query i may see key j iff pos(q_i) - pos(k_j) < window.

    With the causal rule each query sees only its last `window` keys (itself included).
    Positions [T] and [S] give [T, S]; positions with a batch axis give [B, 1, T, S].
    """
    check_window(window)
    query_positions = torch.as_tensor(query_positions)
    key_positions = torch.as_tensor(key_positions, device=query_positions.device)
    if query_positions.dim() == 1 and key_positions.dim() == 1:
        return query_positions[:, None] - key_positions[None, :] < window  # [T, S]
    if query_positions.dim() > 2 or key_positions.dim() > 2:
        raise ValueError(
            f"positions must be [T] or [B, T], got {list(query_positions.shape)} and "
            f"{list(key_positions.shape)}"
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
    positions = torch.arange(total)[None, :] - (total - lengths)[:, None]  # [B, total]
    return positions, (positions >= 0)[:, None, None, :]
