"""Chapter 8, rotary positions: RoPE in the rotate-half and interleaved layouts, and inside
causal attention."""

import torch

from ...rope import apply_rope, rope_cos_sin
from .cases import identity_probe, randn, ref_causal, tril
from .core import Bug, Case, Exercise, Section

CHAPTER = "08_rotary_positions"
ROTATE_HALF = Section(CHAPTER, "8.6", "The layout of Qwen3 and Hugging Face's Llama: rotate half")
POSITIONS_RULE = Section(CHAPTER, "8.10", "RoPE and the positions rule, together")

BUGS = {
    "rope_interleaved_pairs": Bug(
        "Features (2i, 2i+1) were rotated together, the interleaved layout; rotate-half pairs "
        "feature i with feature i + D/2.",
        ROTATE_HALF,
    ),
    "rope_rotate_half_pairs": Bug(
        "Feature i was paired with feature i + D/2, the rotate-half layout; the interleaved "
        "layout rotates the neighbours (2i, 2i+1).",
        ROTATE_HALF,
    ),
    "rope_positions_off_by_one": Bug(
        "Every token is rotated by the angle of the next position: positions + 1 instead of the "
        "positions given (the first token is not rotated at all).",
        POSITIONS_RULE,
    ),
    "rope_on_v": Bug(
        "RoPE was applied to the values too; it belongs on queries and keys only, where it makes "
        "the scores depend on relative position. Turned values carry their absolute positions "
        "into the outputs, which then move whenever the whole text moves.",
        POSITIONS_RULE,
    ),
}


def _ref_rope(x, positions):
    cos, sin = rope_cos_sin(positions, x.shape[-1])
    return apply_rope(x.double(), cos.double(), sin.double())


def _rope_interleaved(x, positions):
    """The interleaved layout: features (2i, 2i+1) turn together by the angle of pair i."""
    cos, sin = rope_cos_sin(positions, x.shape[-1])  # [T, D]: pair i's angle at i and i + D/2
    half = x.shape[-1] // 2
    cos, sin = (c[:, :half].double().repeat_interleave(2, -1) for c in (cos, sin))
    x = x.double()
    turned = torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)  # (-x1, x0, -x3, x2..)
    return x * cos + turned * sin


def _rope_cases():
    gen, cases = torch.Generator().manual_seed(5), []
    for b, h, t, d, start in [(2, 2, 5, 8, 0), (1, 3, 4, 4, 7), (1, 1, 6, 16, 0), (2, 1, 3, 6, 2)]:
        positions = torch.arange(start, start + t)
        cases.append(
            Case(
                (randn(gen, b, h, t, d), positions),
                f"B={b}, H={h}, T={t}, D={d}, positions {start}..{start + t - 1}",
            )
        )
    return cases


def _ref_rope_attention(q, k, v, positions):
    return ref_causal(_ref_rope(q, positions), _ref_rope(k, positions), v)


def _rope_on_v(q, k, v, positions):
    return ref_causal(_ref_rope(q, positions), _ref_rope(k, positions), _ref_rope(v, positions))


def _rope_attention_cases():
    gen, cases = torch.Generator().manual_seed(6), []
    for b, h, t, d, start in [(2, 2, 5, 8, 0), (1, 3, 6, 4, 3), (1, 1, 4, 16, 0)]:
        q, k, v = (randn(gen, b, h, t, d) for _ in range(3))
        positions = torch.arange(start, start + t)
        label = f"B={b}, H={h}, T={t}, D={d}, positions {start}..{start + t - 1}"
        cases.append(Case((q, k, v, positions), label))
    return cases


EXERCISES = {
    "rope": Exercise(
        "fn(x, positions) -> out; x [B, H, T, D], positions [T] (int) -> [B, H, T, D]",
        "RoPE, rotate-half layout (feature i pairs with i + D/2), base 10000.",
        _rope_cases,
        _ref_rope,
        ("out [B, H, T, D]",),
        {
            "rope_interleaved_pairs": _rope_interleaved,
            "rope_positions_off_by_one": lambda x, positions: _ref_rope(x, positions + 1),
        },
    ),
    "rope_interleaved": Exercise(
        "fn(x, positions) -> out; x [B, H, T, D], positions [T] (int) -> [B, H, T, D]",
        "RoPE, interleaved layout (features 2i and 2i+1 turn together), base 10000.",
        _rope_cases,
        _rope_interleaved,
        ("out [B, H, T, D]",),
        {"rope_rotate_half_pairs": _ref_rope},
    ),
    "rope_attention": Exercise(
        "fn(q, k, v, positions) -> out; q, k, v [B, H, T, D], positions [T] -> [B, H, T, D]",
        "Causal attention with RoPE (rotate-half, base 10000) at the given positions.",
        _rope_attention_cases,
        _ref_rope_attention,
        ("out [B, H, T, D]",),
        {"rope_on_v": _rope_on_v},
        lambda: (identity_probe()[0] + (torch.arange(6),), tril(6, 6)),
    ),
}
