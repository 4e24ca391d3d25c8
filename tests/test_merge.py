"""merge_attention (eq. 21.1) and tiled_attention's L: exact merges, -inf parts, gradients."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlib import causal_attention, merge_attention, tiled_attention

from .references import brute_force


def _qkv(seed, batch=2, q_heads=4, kv_heads=2, queries=5, keys=11, dim=8, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, queries, dim, generator=gen, dtype=dtype)
    k = torch.randn(batch, kv_heads, keys, dim, generator=gen, dtype=dtype)
    v = torch.randn(batch, kv_heads, keys, dim, generator=gen, dtype=dtype)
    return q, k, v


def _lse_reference(q, k, query_positions, key_positions):
    """log sum_j e^{z_ij} over the visible keys, in float64 from the scores themselves."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.shape[-1])
    seen = key_positions[:, None, None, :] <= query_positions[:, None, :, None]
    return scores.masked_fill(~seen, -math.inf).logsumexp(-1)


def _part(q, k, v, keys, query_positions):
    """Attention of all queries over the key positions in `keys` (a slice), with its L."""
    key_positions = torch.arange(k.shape[2])[keys].expand(q.shape[0], -1)
    return tiled_attention(
        q, k[:, :, keys], v[:, :, keys], query_positions, key_positions,
        block_size=3, return_lse=True,
    )  # fmt: skip


def test_lse_is_the_log_sum_exp_of_the_visible_scores():
    q, k, v = _qkv(0)
    query_positions = torch.arange(6, 11).expand(2, -1)
    out, lse = tiled_attention(q, k, v, query_positions, block_size=4, return_lse=True)
    key_positions = torch.arange(11).expand(2, -1)
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float64
    assert torch.allclose(lse, _lse_reference(q, k, query_positions, key_positions), atol=1e-12)
    assert torch.equal(out, tiled_attention(q, k, v, query_positions, block_size=4))


def test_a_query_that_sees_no_key_has_lse_minus_infinity_and_output_zero():
    q, k, v = _qkv(1, queries=3, keys=4)
    query_positions = torch.tensor([[0, 1, 2], [0, 1, 2]])
    key_positions = torch.tensor([[1, 2, 3, 4], [0, 1, 2, 3]])  # query 0 of row 0 sees nothing
    out, lse = tiled_attention(q, k, v, query_positions, key_positions, return_lse=True)
    assert torch.all(lse[0, :, 0] == -math.inf) and torch.isfinite(lse[1]).all()
    assert torch.equal(out[0, :, 0], torch.zeros_like(out[0, :, 0]))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), cut=st.integers(0, 11), window=st.integers(1, 4))
def test_two_parts_of_any_split_merge_into_one_call(seed, cut, window):
    q, k, v = _qkv(seed)
    query_positions = torch.arange(6, 11).expand(2, -1)
    whole = causal_attention(q, k, v, query_positions)
    first, second = (
        _part(q, k, v, slice(0, cut), query_positions),
        _part(q, k, v, slice(cut, 11), query_positions),
    )
    out, lse = merge_attention(*first, *second)
    assert torch.allclose(out, whole, atol=1e-12)
    key_positions = torch.arange(11).expand(2, -1)
    assert torch.allclose(lse, _lse_reference(q, k, query_positions, key_positions), atol=1e-12)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), cuts=st.lists(st.integers(0, 11), min_size=2, max_size=2))
def test_the_merge_is_commutative_and_associative(seed, cuts):
    q, k, v = _qkv(seed, dtype=torch.float32)
    query_positions = torch.arange(6, 11).expand(2, -1)
    a, b = sorted(cuts)
    parts = [_part(q, k, v, s, query_positions) for s in (slice(0, a), slice(a, b), slice(b, 11))]
    ab, ba = merge_attention(*parts[0], *parts[1]), merge_attention(*parts[1], *parts[0])
    assert torch.equal(ab[0], ba[0]) and torch.equal(ab[1], ba[1])  # bit for bit
    left = merge_attention(*ab, *parts[2])
    right = merge_attention(*parts[0], *merge_attention(*parts[1], *parts[2]))
    assert torch.allclose(left[0], right[0], atol=1e-6) and torch.allclose(left[1], right[1])
    whole = brute_force(q, k, v, query_positions, torch.arange(11).expand(2, -1))
    assert torch.allclose(left[0].double(), whole, atol=1e-5)


def test_a_part_that_saw_nothing_returns_the_other_exactly():
    gen = torch.Generator().manual_seed(2)
    out, lse = torch.randn(2, 3, 4, generator=gen), torch.randn(2, 3, generator=gen)
    empty_lse = torch.full((2, 3), -math.inf)
    for merged in (
        merge_attention(out, lse, torch.zeros(2, 3, 4), empty_lse),
        merge_attention(torch.zeros(2, 3, 4), empty_lse, out, lse),
    ):
        assert torch.equal(merged[0], out) and torch.equal(merged[1], lse)
    both = merge_attention(torch.zeros(2, 3, 4), empty_lse, torch.zeros(2, 3, 4), empty_lse)
    assert torch.equal(both[0], torch.zeros(2, 3, 4)) and torch.all(both[1] == -math.inf)


def test_causal_shards_with_no_visible_key_merge_without_nan():
    """Ring attention's early queries: the later shard of keys is all in their future."""
    q, k, v = _qkv(3, queries=11, keys=11)
    query_positions = torch.arange(11).expand(2, -1)
    parts = [_part(q, k, v, s, query_positions) for s in (slice(0, 4), slice(4, 11))]
    assert torch.all(parts[1][1][:, :, :4] == -math.inf)  # queries 0-3 see nothing there
    out, lse = merge_attention(*parts[0], *parts[1])
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.allclose(out, causal_attention(q, k, v), atol=1e-12)


def test_gradients_through_the_merge_and_lse_equal_autograd():
    q, k, v = (x.requires_grad_() for x in _qkv(4, keys=9))
    query_positions = torch.arange(4, 9).expand(2, -1)
    parts = [_part(q, k, v, s, query_positions) for s in (slice(0, 5), slice(5, 9))]
    out, lse = merge_attention(*parts[0], *parts[1])
    gen = torch.Generator().manual_seed(5)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum() + (
        lse * torch.randn(lse.shape, generator=gen, dtype=lse.dtype)
    ).sum()
    got = torch.autograd.grad(loss, (q, k, v))
    key_positions = torch.arange(9).expand(2, -1)
    ref_out = causal_attention(q, k, v, query_positions)  # autograd through the reference
    ref_lse = _lse_reference(q, k, query_positions, key_positions)
    gen = torch.Generator().manual_seed(5)
    ref_loss = (ref_out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum() + (
        ref_lse * torch.randn(lse.shape, generator=gen, dtype=lse.dtype)
    ).sum()
    expected = torch.autograd.grad(ref_loss, (q, k, v))
    for g, e in zip(got, expected):
        assert torch.allclose(g, e, atol=1e-10)


def test_gradcheck_of_the_merge_including_a_part_that_saw_nothing():
    gen = torch.Generator().manual_seed(6)
    out_a, out_b = (torch.randn(3, 4, generator=gen, dtype=torch.float64) for _ in "ab")
    lse_a = torch.randn(3, generator=gen, dtype=torch.float64)
    lse_b = torch.tensor([0.3, -math.inf, 1.2], dtype=torch.float64)
    args = [x.requires_grad_() for x in (out_a, lse_a, out_b, lse_b)]
    assert torch.autograd.gradcheck(merge_attention, args)


def test_mismatched_parts_raise():
    with pytest.raises(ValueError, match="parts differ"):
        merge_attention(
            torch.zeros(2, 3, 4), torch.zeros(2, 3), torch.zeros(2, 3, 5), torch.zeros(2, 3)
        )
    with pytest.raises(ValueError, match="without its last axis"):
        merge_attention(
            torch.zeros(2, 3, 4), torch.zeros(2, 4), torch.zeros(2, 3, 4), torch.zeros(2, 4)
        )
