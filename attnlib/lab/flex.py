"""The positions rule (eq. 7.1) handed to PyTorch's FlexAttention as a `mask_mod`.

FlexAttention (`torch.nn.attention.flex_attention`; Dong et al. 2024) runs one fused kernel and
skips every tile that its block mask marks empty. `create_block_mask` builds the block mask from
a `mask_mod(b, h, i, j)`, the same question `visible()` answers for a whole [T, S] grid: may
query i see key j? It evaluates the rule over the blocks every time it is called, so a model
builds one per batch and shares it between layers; `flex_causal_attention` builds one per call.
Called eagerly, `flex_attention` warns and falls back to an unfused path that materialises the
scores; on the CPU (torch 2.13) the fused kernel needs `torch.compile`: Inductor writes C++ and
compiles it with g++ at run time, forward only (PyTorch raises NotImplementedError, "FlexAttention
does not support backward on CPU"; `_check_can_run` refuses earlier with a ValueError naming the
alternative). One compiled function serves the whole process; each new shape of q, k, v costs one
compile (seconds), a repeated shape none. Shapes are static (`dynamic=False`): torch 2.13's CPU
template fails to compile with dynamic shapes. A call that fails inside the compiled function
(a gradient asked for, say) can leave later calls on a slow path, which the early check avoids.
"""

import functools
import os
import shutil

import torch

from ..attention import prepare
from ..masks import check_window


def positions_mask_mod(query_positions, key_positions, window):
    """Eq. 7.1 as a FlexAttention mask_mod: may query i of row b see key j of that row?

    Positions [B, T] and [B, S]; a slot with a negative position is a pad (`left_padding`
    numbers pads so) and is never seen; `window` is a 0-d tensor (pos(q) - pos(k) < window).
    """

    def mask_mod(b, h, i, j):
        q_pos, k_pos = query_positions[b, i], key_positions[b, j]
        return (k_pos <= q_pos) & (k_pos >= 0) & (q_pos - k_pos < window)

    return mask_mod


def _window(window, query_positions, key_positions) -> torch.Tensor:
    """The window (None or `check_window`'s) as a 0-d tensor; None becomes one wider than any
    distance (so no recompile)."""
    if window is None:
        span = int(query_positions.max()) - int(key_positions.min())
        window = max(span, 0) + 1
    return torch.tensor(window, device=query_positions.device)


def positions_block_mask(query_positions, key_positions, window=None, block_size=128):
    """FlexAttention's BlockMask for eq. 7.1 (pads and a window too), positions [B, T], [B, S].

    It lists, per block of `block_size` queries, the key blocks to compute, partial or full.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    if window is not None:
        check_window(window)
    query_positions, key_positions = query_positions.contiguous(), key_positions.contiguous()
    rule = positions_mask_mod(
        query_positions, key_positions, _window(window, query_positions, key_positions)
    )
    batch, queries, keys = (
        query_positions.shape[0],
        query_positions.shape[1],
        key_positions.shape[1],
    )
    device = query_positions.device
    return create_block_mask(rule, batch, None, queries, keys, device=device, BLOCK_SIZE=block_size)


@functools.lru_cache(maxsize=None)
def compiled_flex_attention():
    """`torch.compile(flex_attention)`, made once per process and reused by every call."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _check_can_run(q, k, v) -> None:
    """On the CPU: a supported dtype, no gradients, and a C++ compiler for Inductor."""
    if q.device.type != "cpu":
        return
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(
            f"FlexAttention on the CPU takes float32, float16 or bfloat16, got {q.dtype}: "
            "convert with .float(), or use attnlib.causal_attention"
        )
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise ValueError(
            "FlexAttention has no backward on the CPU: call it under torch.no_grad() or on "
            "detached tensors, or train with attnlib.tiled_attention, which has one"
        )
    compiler = os.environ.get("CXX", "g++")  # the compiler Inductor looks for on Linux
    if not shutil.which(compiler):
        raise RuntimeError(
            f"FlexAttention on the CPU compiles C++ at run time and found no {compiler!r}: "
            "install one (apt-get install g++) or name it in $CXX; attnlib.tiled_attention "
            "computes the same attention without compiling"
        )


def flex_causal_attention(
    q, k, v, query_positions=None, key_positions=None, window=None, scale=None
):
    """`causal_attention` (eq. 2.2 with 7.1 and GQA, 9.1) through compiled FlexAttention.

    q [B, Hq, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] -> [B, Hq, T, Dv]; defaults as there.
    Pads: negative positions (as `left_padding` gives), never read; window: keys pos(q)-pos(k) < w.
    """
    prepared = prepare(q, k, v, query_positions, key_positions, None, scale)
    if window is not None:
        check_window(window)
    _check_can_run(q, k, v)
    if q.shape[2] == 0 or k.shape[2] == 0:  # nothing to compute; FlexAttention needs lengths
        return q.new_zeros(*q.shape[:3], v.shape[3])
    mask = positions_block_mask(prepared.query_positions, prepared.key_positions, window)
    gqa = q.shape[1] != k.shape[1]
    return compiled_flex_attention()(q, k, v, block_mask=mask, scale=prepared.scale, enable_gqa=gqa)
