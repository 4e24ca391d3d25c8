"""Chapter 23, the cache compressed: one decode step of multi-head latent attention, absorbed."""

import math

import torch

from ...mla import rope_rows
from .cases import f64, randn
from .core import Bug, Case, Exercise, Section

CHAPTER = "23_latent_attention"
ABSORPTION = Section(CHAPTER, "23.3", "Absorbing the up-projections")
DECOUPLED = Section(CHAPTER, "23.4", "Why RoPE blocks absorption, and the decoupled key")

BUGS = {
    "mla_rope_before_absorption": Bug(
        "RoPE turned the content query q_C too, before it was absorbed into W_UK; the cached "
        "latents were never turned, so every score but position 0's is off. Only q_R and k_R "
        "carry positions.",
        DECOUPLED,
    ),
    "mla_missing_uv_fold": Bug(
        "The weighted latents went straight into W_O: W_UV, the values' up-projection, must be "
        "folded in first (o_C W_UV W_O, eq. 23.7).",
        ABSORPTION,
    ),
    "mla_scale_latent_width": Bug(
        "The scores were divided by sqrt(d_C + d_R), the width of the absorbed query; MLA's "
        "scale is 1/sqrt(Dn + d_R), the width of the key it stands for (eq. 23.6).",
        ABSORPTION,
    ),
}


def _step(q_c, q_r, c, k_r, w_uk, w_uv, w_o, position, turn_content=False, fold=True, wide=False):
    q_c, q_r, c, k_r, w_uk, w_uv, w_o = f64(q_c, q_r, c, k_r, w_uk, w_uv, w_o)
    where = torch.tensor([position])
    q_r = rope_rows(q_r[:, :, None], where, 10000.0, False)[:, :, 0]  # [B, H, d_R]
    if turn_content:
        q_c = rope_rows(q_c[:, :, None], where, 10000.0, False)[:, :, 0]
    q_lat = torch.einsum("bhd,hcd->bhc", q_c, w_uk)  # [B, H, d_C], eq. 23.4
    width = (c.shape[-1] if wide else w_uk.shape[-1]) + k_r.shape[-1]
    z = (q_lat @ c.transpose(1, 2) + q_r @ k_r.transpose(1, 2)) / math.sqrt(width)  # [B, H, S]
    o_c = torch.softmax(z, dim=-1) @ c  # [B, H, d_C]
    if not fold:
        return torch.einsum("bhc,hcm->bm", o_c, w_o)
    return torch.einsum("bhc,hcd,hdm->bm", o_c, w_uv, w_o)  # [B, d_model], eq. 23.7


def _reference(q_c, q_r, c, k_r, w_uk, w_uv, w_o, position):
    return _step(q_c, q_r, c, k_r, w_uk, w_uv, w_o, position)


def _cases():
    gen, cases = torch.Generator().manual_seed(23), []
    # d_C equals Dv here, so that skipping W_UV still gives an answer of the right shape
    for b, h, s, d_c, nope, d_r, d_model in [
        (2, 2, 5, 6, 4, 4, 8),
        (1, 3, 7, 8, 6, 2, 5),
        (1, 1, 4, 4, 2, 6, 6),
    ]:
        q_c, q_r = randn(gen, b, h, nope), randn(gen, b, h, d_r)
        c, k_r = randn(gen, b, s, d_c), randn(gen, b, s, d_r)
        w_uk, w_uv = randn(gen, h, d_c, nope) / 2, randn(gen, h, d_c, d_c) / 2
        w_o = randn(gen, h, d_c, d_model) / 2
        args = (q_c, q_r, c, k_r, w_uk, w_uv, w_o, s - 1)
        label = f"B={b}, H={h}, S={s}, d_C={d_c}, Dn={nope}, d_R={d_r}, position {s - 1}"
        cases.append(Case(args, label))
    return cases


EXERCISES = {
    "absorbed_decode": Exercise(
        "fn(q_c, q_r, c, k_r, w_uk, w_uv, w_o, position) -> out; q_c [B, H, Dn], q_r [B, H, "
        "d_R] not yet turned, c [B, S, d_C], k_r [B, S, d_R] turned, w_uk [H, d_C, Dn], w_uv "
        "[H, d_C, Dv], w_o [H, Dv, d_model], position an int -> [B, d_model]",
        "One MLA decode step over the cached latents, W_UK absorbed into the query and W_UV "
        "folded into W_O; RoPE (rotate-half, base 1e4) turns q_r to `position`.",
        _cases,
        _reference,
        ("out [B, d_model]",),
        {
            "mla_rope_before_absorption": lambda *a: _step(*a, turn_content=True),
            "mla_missing_uv_fold": lambda *a: _step(*a, fold=False),
            "mla_scale_latent_width": lambda *a: _step(*a, wide=True),
        },
    ),
}
