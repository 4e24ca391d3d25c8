"""attnlib's `tiled_attention` as a transformers attention implementation named "attnlib".

`register()` adds it to transformers' `AttentionInterface` (4.51+ and 5.x), so that any model
whose config says `_attn_implementation = "attnlib"` runs every layer's attention, forward and
backward, through `tiled_attention` (eqs. 14.1-14.2, backward 16.1-16.5).
"""

import torch
from transformers import AttentionInterface

from attnlib import tiled_attention

NAME = "attnlib"


def allowed_from_mask(attention_mask, queries: int, keys: int):
    """transformers' attention_mask -> `tiled_attention`'s `allowed` (True = may attend).

    None stays None (the positions rule, eq. 7.1, alone: keys 0..S-1, queries the last T);
    a bool mask [B, 1, T, >=S] is `allowed` itself; an additive float mask (0 where a key is
    seen, a large negative number, <= -1e4, where it is hidden) becomes `mask == 0`.
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(f"attention_mask of type {type(attention_mask).__name__} is not supported")
    if attention_mask.dim() != 4:
        raise ValueError(
            f"attention_mask must be [B, 1, T, S], got shape {tuple(attention_mask.shape)}"
        )
    mask = attention_mask[:, :, -queries:, :keys]  # transformers may pad the key axis
    if mask.shape[-1] != keys or mask.shape[-2] != queries:
        raise ValueError(
            f"attention_mask {tuple(attention_mask.shape)} does not cover {queries}x{keys}"
        )
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise ValueError(f"attention_mask must be bool or float, got {mask.dtype}")
    hidden = mask <= -1e4  # -inf, dtype min or -1e9: exp() of it is 0 in float32 anyway
    if not torch.all(hidden | (mask == 0)):
        raise ValueError(
            "attention_mask adds biases other than 0 and -inf (e.g. ALiBi): attnlib's attention "
            "supports masks only; use attn_implementation='eager' for biases"
        )
    return ~hidden


def attnlib_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """The registered function: query [B, Hq, T, D], key/value [B, Hkv, S, D] (not repeated)
    -> (output [B, T, Hq, D], None): `tiled_attention`, transposed as transformers expects."""
    if dropout and module.training:
        raise ValueError(f"attnlib's attention has no dropout, got dropout={dropout}")
    if is_causal is False:
        raise ValueError(
            "attnlib's attention is causal (eq. 7.1); this layer asked for is_causal=False"
        )
    allowed = allowed_from_mask(attention_mask, query.shape[2], key.shape[2])
    out = tiled_attention(query, key, value, allowed=allowed, scale=scaling)  # [B, Hq, T, D]
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register "attnlib" with transformers (idempotent) and return the name.

    transformers 5 builds masks per implementation name: "attnlib" gets the sdpa one (a bool
    mask, or None when the positions rule alone is enough); 4.x passes its additive float mask.
    """
    AttentionInterface.register(NAME, attnlib_attention)
    try:  # transformers >= 4.53: masks are chosen per implementation name
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # 4.51: the model builds an additive float mask itself
        return NAME
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def use(model, name: str = NAME):
    """Switch a loaded model's attention implementation ("attnlib", "sdpa", "eager")."""
    if name == NAME:
        register()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # transformers 4.x
        model.config._attn_implementation = name
    return model
