"""Two partial attentions over disjoint sets of keys, merged exactly (eq. 21.1)."""

import torch


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Eq. 21.1: L = log(e^La + e^Lb), O = e^(La-L) Oa + e^(Lb-L) Ob; returns (O, L).

    out [..., T, Dv] and lse [..., T] (natural log, as `tiled_attention(..., return_lse=True)`
    gives them). A query that saw no key in one part has L = -inf there: the other part comes
    back exactly, and two such parts give O = 0, L = -inf, never NaN. Differentiable.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(
            f"parts differ: out {list(out_a.shape)} and {list(out_b.shape)}, "
            f"lse {list(lse_a.shape)} and {list(lse_b.shape)}"
        )
    if out_a.shape[:-1] != lse_a.shape:
        raise ValueError(
            f"lse {list(lse_a.shape)} must be out's shape {list(out_a.shape)} without its last axis"
        )
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(
        torch.isfinite(top), top, torch.zeros_like(top)
    ).detach()  # any shift is exact
    weight_a, weight_b = torch.exp(lse_a - top), torch.exp(lse_b - top)  # e^(La-m), e^(Lb-m)
    total = weight_a + weight_b
    seen = total > 0
    safe = torch.where(seen, total, torch.ones_like(total))  # 0/1, not 0/0, where both saw none
    lse = torch.where(seen, top + torch.log(safe), torch.full_like(total, -torch.inf))
    out = (weight_a / safe)[..., None] * out_a + (weight_b / safe)[..., None] * out_b
    return out, lse
