"""attnlib.alibi (eqs. 24.5-24.6) against BLOOM's `build_alibi_tensor` and BloomAttention, and
against a float64 brute force of the biased softmax."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlib.alibi import alibi_attention, alibi_bias, alibi_slopes

lc = pytest.importorskip("attnlib.lab.long_context")


@pytest.mark.parametrize("heads", [8, 12, 16, 1, 2, 3, 5, 6, 7, 20, 24, 40])
def test_slopes_bias_and_layer_equal_bloom(heads):
    slope_gap, bias_gap, layer_gap = lc.bloom_check(heads, seed=heads)
    assert slope_gap <= 1e-7 and bias_gap <= 1e-6 and layer_gap <= 1e-5


def test_slopes_of_powers_of_two_are_geometric():
    for heads in (1, 2, 4, 8, 16, 64):
        want = [2 ** (-8 * h / heads) for h in range(1, heads + 1)]
        assert alibi_slopes(heads).tolist() == pytest.approx(want, rel=1e-7)


def test_twelve_heads_take_eight_then_odd_slopes_of_sixteen():
    got = alibi_slopes(12).double()
    want = [2 ** (-h) for h in range(1, 9)] + [2 ** (-h / 2) for h in (1, 3, 5, 7)]
    assert got.tolist() == pytest.approx(want, rel=1e-7)
    assert alibi_slopes(12).tolist() != alibi_slopes(16)[:12].tolist()  # not the next power


@settings(max_examples=30, deadline=None)
@given(
    heads=st.integers(1, 6),
    length=st.integers(1, 9),
    dim=st.sampled_from([2, 4, 8]),
    seed=st.integers(0, 2**20),
)
def test_attention_equals_float64_brute_force(heads, length, dim, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(1, heads, length, dim, generator=g, dtype=torch.float64) for _ in range(3)
    )
    slopes = alibi_slopes(heads).double()
    got = alibi_attention(q, k, v, slopes)
    want = torch.zeros_like(got)
    for h in range(heads):
        for i in range(length):
            z = [
                q[0, h, i] @ k[0, h, j] / math.sqrt(dim) - slopes[h] * (i - j) for j in range(i + 1)
            ]
            a = torch.softmax(torch.stack(z), 0)
            want[0, h, i] = (a[:, None] * v[0, h, : i + 1]).sum(0)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_shift_invariance_lets_the_bias_read_the_key_alone():
    """Eq. 24.5 and BLOOM's slope * pos(k_j) differ by slope * pos(q_i): one constant a row."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 7, 8, generator=g, dtype=torch.float64) for _ in range(3))
    slopes = alibi_slopes(4).double()
    pos = torch.arange(7)[None]
    bias = alibi_bias(slopes, pos, pos).double()
    keys_only = slopes.view(1, -1, 1, 1) * pos[:, None, None, :].double()
    torch.testing.assert_close(bias - keys_only, bias[..., :1] - keys_only[..., :1].expand_as(bias))


def test_padding_shifts_positions_not_biases():
    """Left padding: the rule's positions skip the pads, so the real tokens see the bias they
    would see unpadded."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g) for _ in range(3))
    slopes = alibi_slopes(2)
    plain = alibi_attention(q, k, v, slopes)
    pad = torch.zeros(1, 2, 3, 4)
    qp, kp, vp = (torch.cat((pad, t), 2) for t in (q, k, v))
    pos = torch.tensor([[0, 0, 0, 0, 1, 2, 3, 4]])
    real = torch.tensor([[False] * 3 + [True] * 5])[:, None, None, :]
    padded = alibi_attention(qp, kp, vp, slopes, pos, pos, allowed=real)
    torch.testing.assert_close(padded[:, :, 3:], plain, atol=1e-6, rtol=0)


@pytest.mark.parametrize("bad", [0, -3, 2.0, True])
def test_bad_head_counts_are_refused(bad):
    with pytest.raises(ValueError, match="heads"):
        alibi_slopes(bad)


def test_slopes_must_match_heads():
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(ValueError, match="slopes"):
        alibi_attention(q, q, q, alibi_slopes(8))
