import pytest
import torch

from attnlib import KVCache, MultiHeadAttention


def test_equals_the_equations_written_out():
    torch.manual_seed(0)
    layer = MultiHeadAttention(d_in=3, d_model=8, q_heads=4, kv_heads=2)
    x = torch.randn(2, 6, 3)  # [B, T, d_in]
    w_q, w_k, w_v = layer.qkv.weight.split([8, 4, 4])  # fused rows: [Hq*Dh | Hkv*Dh | Hkv*Dh]
    q = (x @ w_q.T).view(2, 6, 4, 2).transpose(1, 2)  # [B, Hq, T, Dh]
    k = (x @ w_k.T).view(2, 6, 2, 2).transpose(1, 2)  # [B, Hkv, T, Dh]
    v = (x @ w_v.T).view(2, 6, 2, 2).transpose(1, 2)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # [B, Hq, T, Dh]
    scores = q @ k.transpose(-2, -1) / 2**0.5 + torch.triu(torch.full((6, 6), -torch.inf), 1)
    y = torch.softmax(scores, -1) @ v  # [B, Hq, T, Dh]
    expected = y.transpose(1, 2).reshape(2, 6, 8) @ layer.out_proj.weight.T  # [B, T, d_model]
    assert torch.allclose(layer(x), expected, atol=1e-6)


def test_parameter_count_equals_one_full_width_head():
    heads = MultiHeadAttention(d_in=64, d_model=64, q_heads=8)
    one_head = MultiHeadAttention(d_in=64, d_model=64, q_heads=1)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(heads) == count(one_head) == 4 * 64 * 64


def test_decoding_one_token_at_a_time_equals_full_pass():
    torch.manual_seed(1)
    layer = MultiHeadAttention(d_in=5, d_model=12, q_heads=6, kv_heads=2, bias=True)
    x = torch.randn(3, 10, 5)
    full = layer(x)
    cache = KVCache()
    prefill = layer(x[:, :7], cache=cache)
    steps = [layer(x[:, t : t + 1], cache=cache) for t in range(7, 10)]
    assert cache.positions.tolist() == list(range(10))
    assert torch.allclose(torch.cat([prefill, *steps], dim=1), full, atol=1e-6)


def test_cache_append_checks_sizes():
    with pytest.raises(ValueError, match="must agree"):
        KVCache().append(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2), torch.arange(2))


def test_constructor_errors():
    with pytest.raises(ValueError, match=r"query heads \(6\) must be a multiple of KV heads \(4\)"):
        MultiHeadAttention(8, 12, 6, 4)
    with pytest.raises(ValueError, match=r"d_model \(10\) must be a multiple of query heads \(4\)"):
        MultiHeadAttention(8, 10, 4)
    with pytest.raises(ValueError, match=r"x must be \[B, T, 8\]"):
        MultiHeadAttention(8, 8, 2)(torch.zeros(1, 3, 5))
