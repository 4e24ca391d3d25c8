"""attnlib.rope_scaling (eqs. 24.1-24.4) against transformers' ROPE_INIT_FUNCTIONS, on
hypothesis-drawn configs, and against float64 formulas written from the papers."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlib import rope_scaling
from attnlib.lab.long_context import rope_config

hf_rope = pytest.importorskip("transformers.modeling_rope_utils")

heads_dim = st.sampled_from([8, 16, 32, 64, 128])
bases = st.sampled_from([10000.0, 500000.0, 1000000.0]) | st.floats(100.0, 1e7)
factors = st.sampled_from([1.0, 2.0, 4.0, 8.0, 32.0]) | st.floats(1.0, 64.0)
lengths = st.sampled_from([128, 2048, 4096, 8192]) | st.integers(16, 10000)


def hf(rule, head_dim, theta, max_positions, seq_len=None, **params):
    config = rope_config(rule, head_dim, theta, max_positions, **params)
    inv_freq, factor = hf_rope.ROPE_INIT_FUNCTIONS[rule](config, None, seq_len=seq_len)
    return inv_freq, float(factor)


def same(ours, theirs):
    torch.testing.assert_close(ours[0], theirs[0], rtol=2e-6, atol=0)
    assert ours[1] == pytest.approx(theirs[1], rel=1e-12)


@settings(max_examples=40, deadline=None)
@given(head_dim=heads_dim, theta=bases, factor=factors)
def test_linear_equals_transformers(head_dim, theta, factor):
    ours = rope_scaling.scaled_frequencies("linear", head_dim, theta, factor=factor)
    same(ours, hf("linear", head_dim, theta, 4096, factor=factor))


@settings(max_examples=40, deadline=None)
@given(
    head_dim=heads_dim, theta=bases, factor=factors, length=lengths, seq_len=st.integers(1, 40000)
)
def test_dynamic_equals_transformers(head_dim, theta, factor, length, seq_len):
    ours = rope_scaling.dynamic_frequencies(head_dim, theta, factor, length, seq_len=seq_len)
    same(ours, hf("dynamic", head_dim, theta, length, seq_len=seq_len, factor=factor))


@settings(max_examples=60, deadline=None)
@given(
    head_dim=heads_dim,
    theta=bases,
    factor=factors.filter(lambda f: f > 1.0),
    length=lengths,
    fast=st.sampled_from([32, 16, 8]),
    slow=st.sampled_from([1, 2]),
    truncate=st.booleans(),
)
def test_yarn_equals_transformers(head_dim, theta, factor, length, fast, slow, truncate):
    ours = rope_scaling.yarn_frequencies(
        head_dim, theta, factor, length, fast=fast, slow=slow, truncate=truncate
    )
    theirs = hf(
        "yarn",
        head_dim,
        theta,
        int(length * factor) + 1,
        factor=factor,
        original_max_position_embeddings=length,
        beta_fast=fast,
        beta_slow=slow,
        truncate=truncate,
    )
    same(ours, theirs)


@settings(max_examples=40, deadline=None)
@given(
    head_dim=heads_dim,
    theta=bases,
    factor=factors,
    length=lengths,
    low=st.sampled_from([1.0, 0.5]),
    high=st.sampled_from([4.0, 8.0, 2.0]),
)
def test_llama3_equals_transformers(head_dim, theta, factor, length, low, high):
    ours = rope_scaling.llama3_frequencies(head_dim, theta, factor, length, low, high)
    theirs = hf(
        "llama3",
        head_dim,
        theta,
        length * 8,
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=length,
    )
    same(ours, theirs)


def test_llama3_31_config_equals_transformers():
    """Llama 3.1 8B's own numbers: D 128, base 500,000, eta 8, T_train 8,192."""
    ours = rope_scaling.llama3_frequencies(128, 500000.0, 8.0, 8192, 1.0, 4.0)
    same(
        ours,
        hf(
            "llama3",
            128,
            500000.0,
            131072,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    )


def test_yarn_against_the_paper_in_float64():
    """YaRN's eq. by hand in float64: pair f's turns over T_train decide its share."""
    head_dim, theta, factor, length = 64, 10000.0, 4.0, 2048
    inv, temp = rope_scaling.yarn_frequencies(head_dim, theta, factor, length, truncate=False)
    for f in range(head_dim // 2):
        base = theta ** (-2 * f / head_dim)
        turns = length * base / (2 * math.pi)
        low = head_dim * math.log(length / (32 * 2 * math.pi)) / (2 * math.log(theta))
        high = head_dim * math.log(length / (1 * 2 * math.pi)) / (2 * math.log(theta))
        keep = 1 - min(max((f - low) / (high - low), 0.0), 1.0)
        assert (keep == 1) == (turns >= 32) and (keep == 0) == (turns <= 1)
        want = keep * base + (1 - keep) * base / factor
        assert inv[f].item() == pytest.approx(want, rel=1e-6)
    assert temp == pytest.approx(1 + 0.1 * math.log(4.0))


def test_ntk_slows_the_slowest_pair_by_eta():
    head_dim, theta, factor = 32, 10000.0, 4.0
    new = rope_scaling.rope_frequencies(head_dim, rope_scaling.ntk_base(head_dim, theta, factor))
    old = rope_scaling.rope_frequencies(head_dim, theta)
    assert new[0] == old[0]  # the fastest pair is untouched
    assert (old[-1] / new[-1]).item() == pytest.approx(factor, rel=1e-5)
    # Hugging Face's dynamic rule at T = eta * T_train with factor 1 is this NTK base
    dyn, _ = rope_scaling.dynamic_frequencies(head_dim, theta, 1.0, 128, seq_len=512)
    torch.testing.assert_close(dyn, new, rtol=1e-6, atol=0)


def test_scaled_cos_sin_matches_the_rotary_layer():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    config = rope_config("yarn", 32, 10000.0, 512, factor=4.0, original_max_position_embeddings=128)
    layer = Qwen3RotaryEmbedding(config)
    positions = torch.arange(0, 512, 7)[None]
    cos, sin = layer(torch.zeros(1, 1, dtype=torch.float32), positions)
    inv, factor = rope_scaling.yarn_frequencies(32, 10000.0, 4.0, 128)
    ours = rope_scaling.scaled_cos_sin(positions, inv, factor)
    torch.testing.assert_close(ours[0], cos, atol=2e-6, rtol=0)
    torch.testing.assert_close(ours[1], sin, atol=2e-6, rtol=0)


@pytest.mark.parametrize("bad", [0.5, 0, -2.0, True, "4"])
def test_factor_below_one_is_refused(bad):
    with pytest.raises(ValueError, match="factor"):
        rope_scaling.linear_frequencies(32, 10000.0, bad)


def test_unknown_rule_is_refused():
    with pytest.raises(ValueError, match="unknown RoPE rule"):
        rope_scaling.scaled_frequencies("ntk-by-parts", 32, factor=2.0)
