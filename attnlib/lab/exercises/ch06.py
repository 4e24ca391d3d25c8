"""Chapter 6, multi-head attention: splitting the features into heads, and each head's share of
the output projection."""

import torch

from ...heads import split_heads
from .cases import randn
from .core import Bug, Case, Exercise, Section

CHAPTER = "06_multi_head"
TRANSPOSE_TRAP = Section(CHAPTER, "6.3", "The transpose trap")
FUSED = Section(CHAPTER, "6.2", "The heads live inside one fused projection")

BUGS = {
    "reshape_without_transpose": Bug(
        "x.reshape(B, H, T, Dh) has the right shape and the wrong data: it mixes tokens into "
        "heads. Reshape to [B, T, H, Dh], then transpose(1, 2).",
        TRANSPOSE_TRAP,
    ),
    "transpose_wrong_axes": Bug(
        "x.transpose(1, 2) swaps tokens with features before the split, which scrambles both. "
        "Split the features first, [B, T, H, Dh], then swap T and H.",
        TRANSPOSE_TRAP,
    ),
    "head_features_strided": Bug(
        "Head h was given the features h, h + H, h + 2H, ... of the concatenated heads, a stride "
        "across the whole width; its D features are one block, the columns hD to (h+1)D - 1 of "
        "w_o. View w_o as [d_model, H, D].",
        TRANSPOSE_TRAP,
    ),
    "w_o_cut_by_rows": Bug(
        "w_o was cut by rows. nn.Linear stores its weight as [out, in], and the heads are the "
        "inputs of the output projection: head h meets the D columns hD to (h+1)D - 1 of w_o.",
        FUSED,
    ),
}


def _reshape_without_transpose(x, heads):
    b, t, f = x.shape
    return x.reshape(b, heads, t, f // heads)


def _transpose_wrong_axes(x, heads):
    b, t, f = x.shape
    return x.transpose(1, 2).reshape(b, heads, t, f // heads)


def _cases():
    gen, cases = torch.Generator().manual_seed(1), []
    for b, t, h, dh in [(2, 5, 3, 4), (1, 4, 2, 6), (3, 2, 4, 2), (1, 1, 2, 3)]:
        cases.append(Case((randn(gen, b, t, h * dh), h), f"B={b}, T={t}, H={h}, Dh={dh}"))
    return cases


# ---- exercise 6.3: each head's share of the output ------------------------------------------


def _ref_contributions(y, w_o):
    """Head h's block of columns of w_o applied to head h: [B, H, T, d_model], in float64."""
    blocks = w_o.double().reshape(w_o.shape[0], y.shape[1], y.shape[3])  # [d_model, H, D]
    return torch.einsum("bhtd,mhd->bhtm", y.double(), blocks)


def _strided(y, w_o):
    blocks = w_o.double().reshape(w_o.shape[0], y.shape[3], y.shape[1])  # [d_model, D, H]
    return torch.einsum("bhtd,mdh->bhtm", y.double(), blocks)


def _by_rows(y, w_o):
    blocks = w_o.double().reshape(y.shape[1], y.shape[3], -1)  # [H, D, d_model]: rows
    return torch.einsum("bhtd,hdm->bhtm", y.double(), blocks)


def _contribution_cases():
    gen, cases = torch.Generator().manual_seed(22), []
    for b, h, t, d in [(2, 3, 5, 4), (1, 2, 4, 8), (2, 4, 3, 2), (1, 1, 2, 6)]:
        args = (randn(gen, b, h, t, d), randn(gen, h * d, h * d) / d)
        cases.append(Case(args, f"B={b}, H={h}, T={t}, D={d}, d_model={h * d}"))
    return cases


EXERCISES = {
    "split_heads": Exercise(
        "fn(x, heads) -> out; x [B, T, H*Dh] -> [B, H, T, Dh]",
        "Split the features into heads and move the heads in front of the tokens.",
        _cases,
        split_heads,
        ("out [B, H, T, Dh]",),
        {
            "reshape_without_transpose": _reshape_without_transpose,
            "transpose_wrong_axes": _transpose_wrong_axes,
        },
    ),
    "head_contributions": Exercise(
        "fn(y, w_o) -> out; y [B, H, T, D], w_o [d_model, H*D] -> [B, H, T, d_model]",
        "Each head's share of the output projection (eq. 6.2): head h times its block of "
        "columns of w_o (nn.Linear's [out, in] layout); the shares sum to the output.",
        _contribution_cases,
        _ref_contributions,
        ("out [B, H, T, d_model]",),
        {"head_features_strided": _strided, "w_o_cut_by_rows": _by_rows},
    ),
}
