"""The stretch exercises (now exercises 5.2, 6.3, 7.4 and 13.3), as tests against independent
references."""

import pytest
import torch

from attnlib import (
    SIX_TOKENS,
    MultiHeadAttention,
    attention_weights,
    causal_attention,
    merge_heads,
    sliding_window,
    split_heads,
)
from attnlib.lab.checks import assert_heads_in_place, labelled, wrong_split
from tests.references import bottom_right_mask, brute_force, sdpa

# The six-token causal table (scale 1) as the early draft of chapter 5 printed it.
DRAFT_TABLE = [
    [1.000, 0.000, 0.000, 0.000, 0.000, 0.000],
    [0.368, 0.632, 0.000, 0.000, 0.000, 0.000],
    [0.228, 0.389, 0.382, 0.000, 0.000, 0.000],
    [0.205, 0.296, 0.292, 0.208, 0.000, 0.000],
    [0.175, 0.225, 0.227, 0.157, 0.216, 0.000],
    [0.139, 0.218, 0.213, 0.142, 0.099, 0.190],
]


SHAPES = [(4, 2, 4), (5, 3, 4), (7, 4, 2), (3, 8, 1)]  # (T, H, Dh); (5, 3, 4) is a trap


@pytest.mark.parametrize("tokens, heads, head_dim", SHAPES)
def test_split_heads_puts_every_heads_features_in_place(tokens, heads, head_dim):
    x = labelled(tokens, heads, head_dim)
    assert_heads_in_place(split_heads, x, heads)
    assert torch.equal(merge_heads(split_heads(x, heads)), x)


@pytest.mark.parametrize("tokens, heads, head_dim", SHAPES)
def test_the_check_catches_reshape_without_transpose(tokens, heads, head_dim):
    x = labelled(tokens, heads, head_dim)
    with pytest.raises(AssertionError, match="head"):
        assert_heads_in_place(wrong_split, x, heads)
    assert not torch.equal(merge_heads(wrong_split(x, heads)), x)


def test_a_round_trip_or_a_spot_check_alone_would_be_fooled():
    x = labelled(tokens=5, heads=3, head_dim=4)  # [1, 5, 12]
    wrong = wrong_split(x, 3)  # [1, 3, 5, 4]
    assert torch.equal(wrong.reshape(1, 5, 12), x)  # a wrong merge undoes a wrong split
    assert torch.equal(wrong[0, 1, 2], x[0, 2, 4:8])  # head 1 of token 2 is right by chance
    assert torch.equal(split_heads(x, 3)[0, 1, 2], torch.tensor([204.0, 205.0, 206.0, 207.0]))


def test_six_token_causal_table():
    x = SIX_TOKENS.double()[None, None]  # [1, 1, 6, 3]
    table = causal_attention(x, x, torch.eye(6, dtype=torch.float64)[None, None], scale=1.0)
    positions = torch.arange(6)[None]  # [1, 6]
    mask = bottom_right_mask(positions, positions)  # [1, 1, 6, 6]
    reference = sdpa(x, x, torch.eye(6, dtype=torch.float64)[None, None], mask, scale=1.0)
    assert torch.allclose(table, reference, atol=1e-12)
    assert torch.allclose(table, attention_weights(x, x, scale=1.0), atol=1e-12)
    expected = torch.tensor(DRAFT_TABLE, dtype=torch.float64)
    expected[5, 0] = 0.138  # the draft's erratum: 0.138471 rounds to 0.138, not 0.139
    assert torch.equal((table[0, 0] * 1000).round() / 1000, expected)
    assert abs(table[0, 0, 5, 0].item() - 0.138471) < 5e-7
    assert torch.equal(torch.triu(table[0, 0], diagonal=1), torch.zeros(6, 6, dtype=table.dtype))
    unmasked = torch.softmax(SIX_TOKENS.double() @ SIX_TOKENS.double().T, dim=-1)
    assert torch.allclose(table[0, 0, 5], unmasked[5])  # the last query sees every key anyway


@pytest.mark.parametrize("window", [1, 2, 3, 5, 12])
def test_sliding_window_matches_brute_force(window):
    g = torch.Generator().manual_seed(window)
    q = torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64)  # [B, Hq, T, D], decode chunk
    k = torch.randn(2, 2, 12, 8, generator=g, dtype=torch.float64)  # [B, Hkv, S, D]
    v = torch.randn(2, 2, 12, 6, generator=g, dtype=torch.float64)  # [B, Hkv, S, Dv]
    query_positions = torch.arange(7, 12).expand(2, 5)  # [B, T]: the last 5 of 12
    key_positions = torch.arange(12).expand(2, 12)  # [B, S]
    allowed = sliding_window(query_positions, key_positions, window)  # [B, 1, T, S]
    out = causal_attention(q, k, v, query_positions, key_positions, allowed=allowed)
    expected = brute_force(q, k, v, query_positions, key_positions, allowed=allowed)
    assert torch.allclose(out, expected, atol=1e-12)
    mask = bottom_right_mask(query_positions, key_positions, allowed)
    assert torch.allclose(out, sdpa(q, k, v, mask), atol=1e-12)
    seen = (attention_weights(q, k, query_positions, key_positions, allowed) > 0).sum(-1)
    expected_seen = (query_positions + 1).clamp(max=window)[:, None, :]  # [B, 1, T]
    assert torch.equal(seen, expected_seen.expand_as(seen))  # min(pos + 1, w) keys each


def test_output_0_of_a_causal_layer_depends_only_on_token_0():
    torch.manual_seed(0)
    layer = MultiHeadAttention(d_in=3, d_model=8, q_heads=2)
    x = SIX_TOKENS[None].clone().requires_grad_(True)  # [1, 6, 3]
    for position in range(6):
        (grad,) = torch.autograd.grad(layer(x)[0, position].sum(), x)  # [1, 6, 3]
        per_token = grad[0].abs().sum(-1)  # [6]
        assert torch.equal(per_token[position + 1 :], torch.zeros(5 - position))
        assert bool((per_token[: position + 1] > 0).all())
