"""attnlib.rope (eqs. 8.4, 8.2-8.5) against float64 pair rotations and Hugging Face's RoPE."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlib.rope import apply_rope, rope_cos_sin, rope_frequencies, rotate_half


def half_pairs(dim: int) -> list:
    """Rotate-half layout (Qwen3, Llama): pair m is features (m, m + D/2)."""
    return [(m, m + dim // 2) for m in range(dim // 2)]


def interleaved_pairs(dim: int) -> list:
    """The RoFormer paper's layout: pair m is features (2m, 2m + 1)."""
    return [(2 * m, 2 * m + 1) for m in range(dim // 2)]


def brute_force_rope(x: torch.Tensor, positions, theta: float, pairs=None) -> torch.Tensor:
    """Turn pair m of x [B, H, T, D] by pos * theta**(-2m/D) radians, in float64, one at a time."""
    out = torch.empty_like(x, dtype=torch.float64)
    pairs = half_pairs(x.shape[-1]) if pairs is None else pairs
    for t, pos in enumerate(positions):
        for m, (i, j) in enumerate(pairs):
            angle = pos * theta ** (-2 * m / x.shape[-1])
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[..., t, i].double(), x[..., t, j].double()
            out[..., t, i] = c * a - s * b
            out[..., t, j] = s * a + c * b
    return out


def test_rope_is_a_rotation_of_feature_pairs():
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    positions = [0, 1, 2, 7, 100]
    cos, sin = rope_cos_sin(torch.tensor(positions), 8, theta=10000.0)  # [T, D]
    got = apply_rope(x, cos.double(), sin.double())
    torch.testing.assert_close(got, brute_force_rope(x, positions, 10000.0), atol=1e-6, rtol=0)


def float64_cos_sin(positions, freqs: torch.Tensor):
    """cos and sin of eq. 8.4 for frequencies [D/2], with the angles taken in float64: [T, D]."""
    angles = torch.tensor(positions, dtype=torch.float64)[:, None] * freqs.double()
    angles = torch.cat((angles, angles), dim=-1)  # [T, D]
    return angles.cos(), angles.sin()


@settings(max_examples=60, deadline=None)
@given(
    i=st.integers(-(10**6), 10**6),
    j=st.integers(-(10**6), 10**6),
    shift=st.integers(-(10**6), 10**6),
    half_dim=st.integers(1, 32),
    theta=st.floats(1.5, 1e7),
    seed=st.integers(0, 2**31 - 1),
)
def test_scores_depend_only_on_the_offset(i, j, shift, half_dim, theta, seed):
    """Eq. 8.2: q_i . k_j after RoPE is q . R((j - i) theta_m) k, whatever i and j are."""
    dim = 2 * half_dim
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, 1, 1, dim, dtype=torch.float64, generator=gen).unbind(0)

    freqs = rope_frequencies(dim, theta)  # [D/2], float32: the reference uses these exactly

    def score(a: int, b: int) -> float:
        qa = apply_rope(q, *float64_cos_sin([a], freqs))
        kb = apply_rope(k, *float64_cos_sin([b], freqs))
        return (qa * kb).sum().item()

    # The reference sees only the offset j - i: it turns k alone, pair by pair, by (j - i) theta_m.
    expected = 0.0
    for m, (a, b) in enumerate(half_pairs(dim)):
        angle = (j - i) * freqs[m].item()
        c, s = math.cos(angle), math.sin(angle)
        kx, ky = k[..., a].item(), k[..., b].item()
        expected += q[..., a].item() * (c * kx - s * ky) + q[..., b].item() * (s * kx + c * ky)
    norm = q.norm().item() * k.norm().item()
    assert score(i, j) == pytest.approx(expected, abs=1e-8 * norm)
    assert score(i + shift, j + shift) == pytest.approx(expected, abs=1e-8 * norm)
    # attnlib's float32 angles (as in transformers) agree within their rounding, which grows with
    # the position: an angle p * theta_m near p carries an error of about p * 2**-24.
    cos, sin = rope_cos_sin(torch.tensor([i, j]), dim, theta)
    exact_cos, exact_sin = float64_cos_sin([i, j], freqs)
    bound = 4 * 2**-24 * (max(abs(i), abs(j)) + 1)
    torch.testing.assert_close(cos.double(), exact_cos, atol=bound, rtol=0)
    torch.testing.assert_close(sin.double(), exact_sin, atol=bound, rtol=0)


def test_rotate_half_layout_is_the_papers_interleaved_layout_permuted():
    """Eq. 8.5: with perm taking feature 2m -> m and 2m + 1 -> m + D/2, rope_half(x[perm]) equals
    rope_interleaved(x)[perm]; the scores are the same in either layout."""
    dim, positions, theta = 12, [0, 3, 41, 1000], 500.0
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(2, 2, 3, len(positions), dim, dtype=torch.float64, generator=gen).unbind(0)
    perm = [2 * m for m in range(dim // 2)] + [2 * m + 1 for m in range(dim // 2)]
    interleaved = brute_force_rope(x, positions, theta, interleaved_pairs(dim))  # [B, H, T, D]
    freqs = torch.tensor([theta ** (-2 * m / dim) for m in range(dim // 2)], dtype=torch.float64)
    cos, sin = float64_cos_sin(positions, freqs)  # the brute force's angles, in the half layout
    half = apply_rope(x[..., perm], cos, sin)
    torch.testing.assert_close(half, interleaved[..., perm], atol=1e-12, rtol=0)
    scores = lambda a, b: a @ b.transpose(-2, -1)  # noqa: E731  [B, H, T, T]
    interleaved_y = brute_force_rope(y, positions, theta, interleaved_pairs(dim))
    torch.testing.assert_close(
        scores(half, apply_rope(y[..., perm], cos, sin)), scores(interleaved, interleaved_y)
    )
    assert not torch.allclose(apply_rope(x, cos, sin), interleaved, atol=1e-3)  # not unpermuted


def test_rope_keeps_norms_and_position_zero_is_identity():
    x = torch.randn(2, 4, 6, 32, generator=torch.Generator().manual_seed(2))
    cos, sin = rope_cos_sin(torch.arange(6), 32)
    rotated = apply_rope(x, cos, sin)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(rotated[:, :, 0], x[:, :, 0])
    assert not torch.allclose(rotated[:, :, 1:], x[:, :, 1:])


def test_rotate_half_turns_each_pair_by_90_degrees():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert rotate_half(x).tolist() == [-3.0, -4.0, 1.0, 2.0]
    torch.testing.assert_close(rotate_half(rotate_half(x)), -x)


def test_batched_positions_rotate_each_row_by_its_own_positions():
    x = torch.randn(2, 3, 4, 8, generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([[0, 1, 2, 3], [-2, -1, 0, 1]])  # e.g. a left-padded second row
    cos, sin = rope_cos_sin(positions, 8)  # [B, T, D]
    assert cos.shape == (2, 4, 8)
    got = apply_rope(x, cos, sin)
    for b in range(2):
        cos_b, sin_b = rope_cos_sin(positions[b], 8)
        torch.testing.assert_close(got[b : b + 1], apply_rope(x[b : b + 1], cos_b, sin_b))
    one_row = rope_cos_sin(positions[1:], 8)  # [1, T, D]: broadcast over the batch
    torch.testing.assert_close(
        apply_rope(x, *one_row), apply_rope(x, *rope_cos_sin(positions[1], 8))
    )


def test_frequencies():
    freqs = rope_frequencies(128, theta=1e6)
    assert freqs.shape == (64,)
    assert freqs[0].item() == 1.0
    assert freqs[-1].item() == pytest.approx(1e6 ** (-126 / 128), rel=1e-5)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="even head dimension"):
        rope_frequencies(7)
    with pytest.raises(ValueError, match="even D"):  # odd head dim reaching apply_rope
        apply_rope(torch.zeros(1, 1, 3, 7), torch.ones(3, 7), torch.zeros(3, 7))
    for theta in (0.0, -10000.0, float("nan")):
        with pytest.raises(ValueError, match="theta must be positive"):
            rope_cos_sin(torch.arange(3), 8, theta=theta)
    with pytest.raises(ValueError, match="integers"):
        rope_cos_sin(torch.tensor([0.0, 1.0]), 8)
    with pytest.raises(ValueError, match=r"\[T\] or \[B, T\]"):
        rope_cos_sin(torch.zeros(1, 1, 2, dtype=torch.long), 8)
    cos, sin = rope_cos_sin(torch.arange(3), 8)
    with pytest.raises(ValueError, match="T, D"):  # 3 positions for 4 tokens
        apply_rope(torch.zeros(1, 1, 4, 8), cos, sin)
    with pytest.raises(ValueError, match="one position per token"):  # 2 rows of positions for 3
        apply_rope(torch.zeros(3, 1, 3, 8), *rope_cos_sin(torch.arange(6).view(2, 3), 8))
    with pytest.raises(ValueError, match=r"\[B, H, T, D\]"):
        apply_rope(torch.zeros(3, 8), cos, sin)


@pytest.mark.parametrize(
    "geometry",
    [
        {},  # Qwen3-0.6B: 16 query heads and 8 KV heads of 128, theta 1e6
        {
            "hidden_size": 32,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "rope_theta": 500.0,
        },
    ],
    ids=["qwen3-0.6b", "small"],
)
def test_matches_hugging_face_qwen3_rope(geometry):
    pytest.importorskip("transformers")
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import (
        Qwen3RotaryEmbedding,
        apply_rotary_pos_emb,
    )

    from attnlib.lab.hf_compat import rope_theta
    from attnlib.lab.qwen3 import qwen3_config

    config = qwen3_config(**geometry)  # built locally: nothing is downloaded
    assert isinstance(config, Qwen3Config)
    dim, theta = config.head_dim, rope_theta(config)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [5, 6, 7, 8, 9, 10, 11, 12, 13, 500]])
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, config.num_attention_heads, 10, dim, generator=gen)  # [B, Hq, T, D]
    k = torch.randn(2, config.num_key_value_heads, 10, dim, generator=gen)  # [B, Hkv, T, D]
    hf_cos, hf_sin = Qwen3RotaryEmbedding(config)(q, positions)  # [B, T, D]
    cos, sin = rope_cos_sin(positions, dim, theta)
    torch.testing.assert_close(cos, hf_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, hf_sin, atol=1e-6, rtol=0)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    torch.testing.assert_close(apply_rope(q, cos, sin), hf_q, atol=1e-5, rtol=0)
    torch.testing.assert_close(apply_rope(k, cos, sin), hf_k, atol=1e-5, rtol=0)
