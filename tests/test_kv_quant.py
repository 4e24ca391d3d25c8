"""attnlib.kv_quant (eqs. 23.10-23.11) against loops, and the hooks of attnlib.lab.kv_quant_lm."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlib.kv_quant import bits_per_number, bytes_per_token, fp8_roundtrip, quantize


def loop_quantize(x, bits, symmetric):
    """One group, written out: the levels of eq. 23.10 and the nearest one to each number."""
    x = [float(v) for v in x]
    if symmetric:
        top = 2 ** (bits - 1) - 1
        eta = max(abs(v) for v in x) / top
        levels = [eta * n for n in range(-top, top + 1)]
    else:
        top = 2**bits - 1
        eta = (max(x) - min(x)) / top
        levels = [min(x) + eta * n for n in range(top + 1)]
    return [min(levels, key=lambda level: abs(level - v)) for v in x], eta


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 8),
    st.sampled_from([2, 4, 8]),
    st.booleans(),
    st.sampled_from([-1, -2]),
    st.integers(0, 10_000),
)
def test_quantize_is_nearest_level_per_group(bits, group, symmetric, axis, seed):
    x = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    out = quantize(x, bits, group, axis=axis, symmetric=symmetric)
    moved, moved_out = x.movedim(axis, -1), out.movedim(axis, -1)
    for index in range(moved.shape[0]):
        for row in range(moved.shape[1]):
            for start in range(0, 8, group):
                chunk = moved[index, row, start : start + group]
                expected, eta = loop_quantize(chunk, bits, symmetric)
                got = moved_out[index, row, start : start + group]
                # ties may round either way: never further than half a step from x
                assert torch.allclose(got, torch.tensor(expected, dtype=x.dtype), atol=1e-9) or (
                    (got - chunk).abs().max() <= eta / 2 + 1e-12
                )
                assert (got - chunk).abs().max() <= eta / 2 + 1e-12


def test_levels_used():
    x = torch.linspace(-1, 1, 64, dtype=torch.float64)[None]
    assert quantize(x, 2, 64, symmetric=False).unique().numel() == 4
    assert quantize(x, 2, 64, symmetric=True).unique().numel() == 3
    assert quantize(x, 3, 64, symmetric=False).unique().numel() == 8


def test_constant_group_and_dtype():
    x = torch.full((2, 32), 0.7)
    assert torch.equal(quantize(x, 4, 32), x)
    assert quantize(torch.zeros(2, 32), 4, 32, symmetric=True).abs().max() == 0
    assert quantize(torch.randn(2, 32, dtype=torch.bfloat16), 4, 32).dtype == torch.bfloat16


def test_bad_arguments():
    with pytest.raises(ValueError, match="divide"):
        quantize(torch.zeros(2, 30), 4, 32)
    with pytest.raises(ValueError, match="bits"):
        quantize(torch.zeros(2, 32), 1, 32, symmetric=True)


def test_bits_with_metadata():
    assert bits_per_number(2, 32) == 3.0  # fp16 scale and offset: one more bit a number
    assert bits_per_number(4, 32, symmetric=True) == 4.5
    assert bits_per_number(4, 128) == 4.25
    assert bytes_per_token(64, 4, 32) == 64 * 5 / 8


def test_fp8_error_is_at_most_half_a_mantissa_step():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = fp8_roundtrip(x)
    normal = x.abs() > x.abs().max() / 448 * 2**-6  # e4m3's normal range after the scale
    assert ((out - x).abs()[normal] <= x.abs()[normal] * 2**-4 + 1e-15).all()
    assert out.unique().numel() < 256


transformers = pytest.importorskip("transformers")
from attnlib.lab import kv_quant_lm  # noqa: E402


@pytest.fixture(scope="module")
def model_and_windows():
    model, tokenizer = kv_quant_lm.lm.load(attn_implementation="sdpa")
    return model, kv_quant_lm.heldout_windows(tokenizer, count=4)


def test_hooks_change_nothing_at_16_bits_and_are_removed(model_and_windows):
    model, windows = model_and_windows
    base = kv_quant_lm.mean_loss(model, windows)
    for scheme in kv_quant_lm.SCHEMES:
        with kv_quant_lm.quantized(model, scheme, 16):
            assert abs(kv_quant_lm.mean_loss(model, windows) - base) < 1e-4
        with kv_quant_lm.quantized(model, scheme, 2):
            assert kv_quant_lm.mean_loss(model, windows) - base > 1e-3
    assert kv_quant_lm.mean_loss(model, windows) == base  # the hooks are gone


def test_captured_shapes_and_spread(model_and_windows):
    model, windows = model_and_windows
    keys, values = kv_quant_lm.captured(model, windows)
    config = model.config
    shape = (config.num_hidden_layers, 4, 128, config.num_key_value_heads, config.head_dim)
    assert keys.shape == values.shape == shape
    flat = torch.ones(1, 2, 3, 1, 4)
    assert kv_quant_lm.channel_spread(flat) == 1.0
