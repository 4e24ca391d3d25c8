"""attnlib.rope (eq. 3.17) against a float64 pair-rotation brute force and Hugging Face's RoPE."""

import math

import pytest
import torch

from attnlib.rope import apply_rope, rope_cos_sin, rope_frequencies, rotate_half


def brute_force_rope(x: torch.Tensor, positions, theta: float) -> torch.Tensor:
    """Turn each pair (i, i + D/2) of x [B, H, T, D] by pos * theta**(-2i/D) radians, in float64."""
    out = torch.empty_like(x, dtype=torch.float64)
    half = x.shape[-1] // 2
    for t, pos in enumerate(positions):
        for i in range(half):
            angle = pos * theta ** (-2 * i / x.shape[-1])
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[..., t, i].double(), x[..., t, i + half].double()
            out[..., t, i] = c * a - s * b
            out[..., t, i + half] = s * a + c * b
    return out


def test_rope_is_a_rotation_of_feature_pairs():
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    positions = [0, 1, 2, 7, 100]
    cos, sin = rope_cos_sin(torch.tensor(positions), 8, theta=10000.0)  # [T, D]
    got = apply_rope(x, cos.double(), sin.double())
    torch.testing.assert_close(got, brute_force_rope(x, positions, 10000.0), atol=1e-6, rtol=0)


def test_rope_scores_depend_only_on_relative_position():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, 1, 16, dtype=torch.float64, generator=gen)
    k = torch.randn(1, 1, 1, 16, dtype=torch.float64, generator=gen)

    def score(m: int, n: int) -> float:
        cos_m, sin_m = rope_cos_sin(torch.tensor([m]), 16, theta=1e6)
        cos_n, sin_n = rope_cos_sin(torch.tensor([n]), 16, theta=1e6)
        qm = apply_rope(q, cos_m.double(), sin_m.double())
        kn = apply_rope(k, cos_n.double(), sin_n.double())
        return (qm * kn).sum().item()

    assert score(5, 2) == pytest.approx(score(105, 102), abs=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 4), abs=1e-3)  # a different offset differs


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


def test_frequencies():
    freqs = rope_frequencies(128, theta=1e6)
    assert freqs.shape == (64,)
    assert freqs[0].item() == 1.0
    assert freqs[-1].item() == pytest.approx(1e6 ** (-126 / 128), rel=1e-5)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="even head dimension"):
        rope_frequencies(7)
    with pytest.raises(ValueError, match="integers"):
        rope_cos_sin(torch.tensor([0.0, 1.0]), 8)
    with pytest.raises(ValueError, match=r"\[T\] or \[B, T\]"):
        rope_cos_sin(torch.zeros(1, 1, 2, dtype=torch.long), 8)
    cos, sin = rope_cos_sin(torch.arange(3), 8)
    with pytest.raises(ValueError, match="T, D"):
        apply_rope(torch.zeros(1, 1, 4, 8), cos, sin)
    with pytest.raises(ValueError, match=r"\[B, H, T, D\]"):
        apply_rope(torch.zeros(3, 8), cos, sin)


def test_matches_hugging_face_qwen3_rope():
    pytest.importorskip("transformers")
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import (
        Qwen3RotaryEmbedding,
        apply_rotary_pos_emb,
    )

    from attnlib.lab.qwen3 import qwen3_config

    config = qwen3_config()  # head_dim 128, rope_theta 1e6
    assert isinstance(config, Qwen3Config)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [5, 6, 7, 8, 9, 10, 11, 12, 13, 500]])
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 16, 10, 128, generator=gen)  # [B, Hq, T, D]
    k = torch.randn(2, 8, 10, 128, generator=gen)  # [B, Hkv, T, D]
    hf_cos, hf_sin = Qwen3RotaryEmbedding(config)(q, positions)  # [B, T, D]
    cos, sin = rope_cos_sin(positions, 128, theta=1e6)
    torch.testing.assert_close(cos, hf_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, hf_sin, atol=1e-6, rtol=0)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    torch.testing.assert_close(apply_rope(q, cos, sin), hf_q, atol=1e-5, rtol=0)
    torch.testing.assert_close(apply_rope(k, cos, sin), hf_k, atol=1e-5, rtol=0)
