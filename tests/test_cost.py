import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from attnlib import (
    attention_flops,
    causal_attention,
    growth_exponent,
    longest_fitting_length,
    score_matrix_bytes,
    visible_pairs,
)
from attnlib.attention import prepare
from attnlib.masks import visible


def test_seed_numbers():
    assert score_matrix_bytes(8192, 8192) == 256 * 2**20  # one fp32 head at T = 8,192
    assert score_matrix_bytes(8192, 8192, torch.bfloat16) == 128 * 2**20
    assert score_matrix_bytes(8192, 8192, heads=8, batch=2) == 16 * 256 * 2**20
    assert attention_flops(4096, 4096, 64) == 4 * 4096**2 * 64  # 4 T^2 D
    assert attention_flops(10, 10, 6, value_dim=2) == 2 * 100 * 6 + 2 * 100 * 2


@pytest.mark.parametrize(
    "queries, keys, dim, value_dim, heads", [(7, 7, 8, 8, 2), (3, 11, 5, 9, 4)]
)
def test_flops_match_pytorchs_flop_counter(queries, keys, dim, value_dim, heads):
    q = torch.randn(2, heads, queries, dim)
    k, v = torch.randn(2, heads, keys, dim), torch.randn(2, heads, keys, value_dim)
    with FlopCounterMode(display=False) as counter:
        causal_attention(q, k, v)  # the naive method computes every pair, masked or not
    expected = attention_flops(queries, keys, dim, value_dim, heads=heads, batch=2)
    assert counter.get_total_flops() == expected


@settings(max_examples=40, deadline=None)
@given(queries=st.integers(0, 30), extra=st.integers(0, 30))
def test_visible_pairs_counts_the_mask(queries, extra):
    keys = queries + extra
    q, k = torch.zeros(1, 1, queries, 1), torch.zeros(1, 1, keys, 1)
    query_pos, key_pos = prepare(q, k, k)[:2]  # the default positions of causal_attention
    assert visible_pairs(queries, keys) == int(visible(query_pos, key_pos).sum())
    causal = attention_flops(queries, keys, 4, causal=True)
    assert causal == 2 * visible_pairs(queries, keys) * (4 + 4)


def test_causal_flops_are_about_half():
    dense, causal = attention_flops(4096, 4096, 64), attention_flops(4096, 4096, 64, causal=True)
    assert causal == 4 * 64 * 4096 * 4097 // 2
    assert abs(causal / dense - 0.5) < 1e-3


@pytest.mark.parametrize("memory", [24 * 2**30, 16 * 10**9, 10**6, 12345])
@pytest.mark.parametrize("heads, copies", [(1, 1), (8, 3), (8, 3.03)])
def test_longest_fitting_length_is_the_exact_bound(memory, heads, copies):
    length = longest_fitting_length(memory, heads=heads, copies=copies)
    assert copies * score_matrix_bytes(length, length, heads=heads) <= memory
    assert copies * score_matrix_bytes(length + 1, length + 1, heads=heads) > memory


def test_longest_fitting_length_at_24_gib():
    assert longest_fitting_length(24 * 2**30, heads=8, copies=3) == 16384  # 3 * 8 * 4 * 2^28
    assert longest_fitting_length(24 * 2**30) == 80264  # one fp32 head alone


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match=r"more queries \(5\) than keys \(4\)"):
        visible_pairs(5, 4)
    with pytest.raises(ValueError, match="dim"):
        attention_flops(4, 4, 0)
    with pytest.raises(ValueError, match="heads"):
        score_matrix_bytes(4, 4, heads=-1)
    with pytest.raises(ValueError, match="copies"):
        longest_fitting_length(100, copies=0)


def test_growth_exponent_recovers_a_power_law():
    sizes = [512, 1024, 2048, 4096]
    assert growth_exponent(sizes, [3.0 * s**2 for s in sizes]) == pytest.approx(2.0)
    assert growth_exponent(sizes, [7.0 * s for s in sizes]) == pytest.approx(1.0)
    assert growth_exponent([512], [1.0]) is None
