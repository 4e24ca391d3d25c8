import pytest
import torch

from attnlib import (
    attention_weights,
    causal_attention,
    left_padding,
    loops,
    repeat_kv,
    sliding_window,
    split_heads,
    tiled_attention,
)

from .references import bottom_right_mask, brute_force, sdpa


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def arange_rows(batch, start, stop):
    return torch.arange(start, stop).expand(batch, stop - start)


@pytest.mark.parametrize(
    "queries,keys", [(6, 6), (1, 58), (8, 48), (3, 5)], ids=["square", "decode", "chunk", "small"]
)
def test_equals_sdpa_with_bottom_right_mask(queries, keys):
    q, k, v = (
        randn(2, 4, queries, 16, seed=1),
        randn(2, 2, keys, 16, seed=2),
        randn(2, 2, keys, 8, seed=3),
    )
    mask = bottom_right_mask(arange_rows(2, keys - queries, keys), arange_rows(2, 0, keys))
    assert torch.allclose(causal_attention(q, k, v), sdpa(q, k, v, mask), atol=1e-6)


def test_sdpa_is_causal_is_top_left_so_wrong_for_decoding():
    q, k, v = randn(1, 2, 1, 8, seed=1), randn(1, 2, 58, 8, seed=2), randn(1, 2, 58, 8, seed=3)
    top_left = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    # One decode query under is_causal=True sees only key 0: its output is v[..., 0, :].
    assert torch.allclose(top_left[:, :, 0], v[:, :, 0], atol=1e-6)
    assert not torch.allclose(causal_attention(q, k, v), top_left, atol=1e-3)
    query_positions = torch.tensor([[57]])
    assert torch.allclose(
        causal_attention(q, k, v, query_positions=query_positions),
        sdpa(q, k, v, bottom_right_mask(query_positions, arange_rows(1, 0, 58))),
        atol=1e-6,
    )


def test_default_is_the_causal_triangle_when_square():
    q, k, v = randn(1, 3, 7, 4, seed=4), randn(1, 3, 7, 4, seed=5), randn(1, 3, 7, 4, seed=6)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(causal_attention(q, k, v), expected, atol=1e-6)


def test_changing_the_last_token_leaves_earlier_outputs_bit_identical():
    x = randn(2, 4, 9, 8, seed=7)
    changed = x.clone()
    changed[:, :, -1] = randn(2, 4, 8, seed=8) * 100
    before, after = causal_attention(x, x, x), causal_attention(changed, changed, changed)
    assert torch.equal(before[:, :, :-1], after[:, :, :-1])
    assert not torch.equal(before[:, :, -1], after[:, :, -1])


def test_gqa_query_head_reads_kv_head_h_div_group():
    q, k, v = randn(1, 16, 3, 8, seed=9), randn(1, 8, 3, 8, seed=10), randn(1, 8, 3, 8, seed=11)
    base = causal_attention(q, k, v)
    poked = v.clone()
    poked[:, 5] += 1.0  # perturb KV head 5 only
    changed = (causal_attention(q, k, poked) - base).abs().amax(dim=(0, 2, 3)) > 0
    assert changed.nonzero().flatten().tolist() == [10, 11]  # 10 // 2 == 11 // 2 == 5
    assert torch.equal(repeat_kv(k, 2)[:, 11], k[:, 5])


def test_scale_and_dv_differs():
    q, k, v = randn(1, 2, 4, 6, seed=12), randn(1, 2, 4, 6, seed=13), randn(1, 2, 4, 3, seed=14)
    positions = arange_rows(1, 0, 4)
    expected = brute_force(q, k, v, positions, positions, scale=0.3)
    assert torch.allclose(causal_attention(q, k, v, scale=0.3).double(), expected, atol=1e-6)


def test_query_that_sees_nothing_outputs_zeros_like_sdpa():
    q, k, v = randn(1, 1, 3, 4, seed=15), randn(1, 1, 3, 4, seed=16), randn(1, 1, 3, 4, seed=17)
    allowed = torch.tensor([[True, False, False], [False, False, False], [True, True, True]])
    out = causal_attention(q, k, v, allowed=allowed)
    assert torch.equal(out[0, 0, 1], torch.zeros(4))
    mask = bottom_right_mask(arange_rows(1, 0, 3), arange_rows(1, 0, 3), allowed)
    assert torch.allclose(out, sdpa(q, k, v, mask), atol=1e-6)
    assert not torch.isnan(out).any()


def test_float64_stays_float64_and_half_is_computed_in_float32():
    q = randn(1, 2, 5, 8, seed=18, dtype=torch.float64)
    assert causal_attention(q, q, q).dtype == torch.float64
    assert attention_weights(q, q).dtype == torch.float64
    half = q.to(torch.bfloat16)
    assert causal_attention(half, half, half).dtype == torch.bfloat16
    assert attention_weights(half, half).dtype == torch.float32


def test_sliding_window_sees_only_last_w_keys():
    positions = torch.arange(10)
    allowed = sliding_window(positions, positions, 3)
    q = randn(1, 1, 10, 4, seed=19)
    weights = attention_weights(q, q, allowed=allowed)[0, 0]
    for i in range(10):
        assert (weights[i] > 0).nonzero().flatten().tolist() == list(range(max(0, i - 2), i + 1))
    batched = sliding_window(positions.expand(2, 10), positions.expand(2, 10), 3)
    assert batched.shape == (2, 1, 10, 10) and torch.equal(batched[1, 0], allowed)


def test_left_padding_rows_equal_their_unpadded_sequences():
    lengths = [5, 3]
    positions, allowed = left_padding(lengths, 5)
    assert positions.tolist() == [[0, 1, 2, 3, 4], [-2, -1, 0, 1, 2]]
    x = randn(2, 2, 5, 4, seed=20)
    out = causal_attention(x, x, x, positions, positions, allowed=allowed)
    alone = causal_attention(x[1:, :, 2:], x[1:, :, 2:], x[1:, :, 2:])
    assert torch.allclose(out[1:, :, 2:], alone, atol=1e-6)
    assert torch.equal(out[1, :, :2], torch.zeros(2, 2, 4))  # pad queries see nothing


@pytest.mark.parametrize(
    "queries,keys", [(6, 6), (1, 58), (9, 4)], ids=["square", "one-query", "more-queries"]
)
@pytest.mark.parametrize("fused", [False, True], ids=["explicit", "fused"])
def test_unmasked_mode_equals_sdpa_with_no_mask(queries, keys, fused):
    q, k, v = randn(2, 4, queries, 16, seed=8), randn(2, 2, keys, 16, seed=9), randn(2, 2, keys, 8)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    out = causal_attention(q, k, v, causal=False, fused=fused)
    assert torch.allclose(out, expected, atol=1e-6)
    everyone = torch.ones(2, 1, queries, keys, dtype=torch.bool)
    expected64 = brute_force(q, k, v, torch.ones(2, queries).long() * keys, arange_rows(2, 0, keys))
    assert torch.allclose(out.double(), expected64, atol=1e-6)
    weights = attention_weights(q, k, causal=False)  # [B, Hq, T, S]: nothing hidden
    assert torch.all(weights > 0) and torch.allclose(weights.sum(-1), torch.ones(2, 4, queries))
    assert torch.allclose(causal_attention(q, k, v, causal=False, allowed=everyone), out, atol=1e-6)


def test_unmasked_mode_keeps_allowed_and_its_gradients_match_autograd_of_float64():
    q, k, v = (randn(1, 2, 5, 8, seed=s, dtype=torch.float64).requires_grad_() for s in (1, 2, 3))
    allowed = randn(1, 1, 5, 5, seed=4) > -0.5  # an arbitrary key mask, no causal triangle
    allowed[..., 0] = True
    out = causal_attention(q, k, v, allowed=allowed, causal=False)
    everything = torch.full((1, 5), 5), arange_rows(1, 0, 5)  # positions that hide nothing
    expected = brute_force(q.detach(), k.detach(), v.detach(), *everything, allowed)
    assert torch.allclose(out, expected, atol=1e-12)
    assert not torch.allclose(out, causal_attention(q, k, v, allowed=allowed), atol=1e-3)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    mask = allowed.expand(1, 2, 5, 5)
    sdpa_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for got, want in zip(grads, torch.autograd.grad(sdpa_out.square().sum(), (q, k, v))):
        assert torch.allclose(got, want, atol=1e-10)


BAD_CALLS = {
    "rank": (lambda: causal_attention(randn(2, 3, 4), randn(1, 2, 3, 4), randn(1, 2, 3, 4)), "4-D"),
    "head dim": (
        lambda: causal_attention(randn(1, 2, 3, 4), randn(1, 2, 3, 5), randn(1, 2, 3, 5)),
        "head dimension of q (4) must equal that of k (5)",
    ),
    "batch": (
        lambda: causal_attention(randn(2, 2, 3, 4), randn(1, 2, 3, 4), randn(1, 2, 3, 4)),
        "batch sizes differ",
    ),
    "gqa": (
        lambda: causal_attention(randn(1, 6, 3, 4), randn(1, 4, 3, 4), randn(1, 4, 3, 4)),
        "query heads (6) must be a multiple of KV heads (4)",
    ),
    "positions length": (
        lambda: causal_attention(*[randn(1, 1, 3, 4)] * 3, query_positions=torch.arange(4)),
        "query_positions must have shape [3] or [1, 3], got [4]",
    ),
    "positions shape": (
        lambda: causal_attention(*[randn(2, 1, 3, 4)] * 3, key_positions=torch.zeros(3, 3).long()),
        "key_positions must have shape [3] or [2, 3], got [3, 3]",
    ),
    "float positions": (
        lambda: causal_attention(*[randn(1, 1, 3, 4)] * 3, key_positions=torch.zeros(3)),
        "must hold integers",
    ),
    "allowed broadcast": (
        lambda: causal_attention(*[randn(1, 2, 3, 4)] * 3, allowed=torch.ones(3, 4).bool()),
        "cannot broadcast to [B, Hq, T, S] = [1, 2, 3, 3]",
    ),
    "allowed too big": (
        lambda: causal_attention(*[randn(1, 2, 3, 4)] * 3, allowed=torch.ones(2, 1, 3, 3).bool()),
        "cannot broadcast",
    ),
    "allowed dtype": (
        lambda: causal_attention(*[randn(1, 2, 3, 4)] * 3, allowed=torch.ones(3, 3)),
        "boolean",
    ),
    "window": (lambda: sliding_window(torch.arange(3), torch.arange(3), 0), "at least 1"),
    "dtype": (
        lambda: causal_attention(randn(1, 1, 3, 4), randn(1, 1, 3, 4).half(), randn(1, 1, 3, 4)),
        "must share a floating-point dtype",
    ),
    "device": (
        lambda: causal_attention(
            randn(1, 1, 3, 4), randn(1, 1, 3, 4).to("meta"), randn(1, 1, 3, 4).to("meta")
        ),
        "one device",
    ),
    "too many queries": (
        lambda: causal_attention(randn(1, 1, 5, 4), randn(1, 1, 3, 4), randn(1, 1, 3, 4)),
        "more queries (5) than keys (3)",
    ),
    "kv mismatch": (
        lambda: causal_attention(randn(1, 1, 3, 4), randn(1, 1, 3, 4), randn(1, 1, 2, 4)),
        "same KV heads and keys",
    ),
    "split heads": (lambda: split_heads(randn(1, 3, 10), 4), "features (10) must be a multiple"),
    "scale zero": (
        lambda: causal_attention(*[randn(1, 1, 3, 4)] * 3, scale=0.0),
        "finite positive",
    ),
    "scale string": (lambda: causal_attention(*[randn(1, 1, 3, 4)] * 3, scale="1"), "a number"),
    "positions without the rule": (
        lambda: causal_attention(*[randn(1, 1, 3, 4)] * 3, causal=False, key_positions=[0, 1, 2]),
        "positions only matter under the causal rule",
    ),
}

ENTRY_POINTS = {
    "causal_attention": lambda scale: causal_attention(*[randn(1, 1, 3, 4)] * 3, scale=scale),
    "fused": lambda scale: causal_attention(*[randn(1, 1, 3, 4)] * 3, scale=scale, fused=True),
    "attention_weights": lambda scale: attention_weights(*[randn(1, 1, 3, 4)] * 2, scale=scale),
    "tiled_attention": lambda scale: tiled_attention(*[randn(1, 1, 3, 4)] * 3, scale=scale),
    "loops": lambda scale: loops.causal_attention([[1.0]], [[1.0]], [[1.0]], 1, 1, scale=scale),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=list(ENTRY_POINTS))
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0, 0.0])
def test_every_entry_point_rejects_a_scale_that_is_not_finite_and_positive(entry, scale):
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        ENTRY_POINTS[entry](scale)


@pytest.mark.parametrize("case", BAD_CALLS, ids=list(BAD_CALLS))
def test_bad_input_raises_value_error_naming_the_problem(case):
    call, message = BAD_CALLS[case]
    with pytest.raises(ValueError) as error:
        call()
    assert message in str(error.value)


def test_no_keys_at_all_gives_zeros():
    q = randn(1, 2, 3, 4)
    empty = torch.zeros(1, 2, 0, 4)
    out = causal_attention(q, empty, empty, query_positions=torch.arange(3))
    assert torch.equal(out, torch.zeros(1, 2, 3, 4))
