"""attnlib.mla (chapter 23) against a float64 brute force, itself, and DeepseekV3Attention."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlib.mla import (
    LatentCache,
    MLAWeights,
    absorbed_query,
    expand,
    folded_output,
    latents,
    mla_absorbed,
    mla_naive,
    queries,
    rope_before_absorption,
    rope_rows,
)
from attnlib.rope import apply_rope, rope_cos_sin


def random_weights(seed, d_model=16, heads=2, d_q=8, d_c=6, d_r=4, nope=4, dv=3, interleaved=True):
    """Seeded float64 MLA maps; d_q=None drops the query compression."""
    g = torch.Generator().manual_seed(seed)

    def n(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(shape[-2])

    q_in = d_model if d_q is None else d_q
    return MLAWeights(
        w_dq=None if d_q is None else n(d_model, d_q),
        gain_q=None if d_q is None else torch.rand(d_q, generator=g, dtype=torch.float64) + 0.5,
        w_uq=n(q_in, heads * (nope + d_r)).view(q_in, heads, nope + d_r),
        w_dkv=n(d_model, d_c),
        gain_kv=torch.rand(d_c, generator=g, dtype=torch.float64) + 0.5,
        w_kr=n(d_model, d_r),
        w_uk=n(heads, d_c, nope),
        w_uv=n(heads, d_c, dv),
        w_o=n(heads, dv, d_model),
        interleaved=interleaved,
    )


def brute_force(x, w):
    """Float64 loops over heads and token pairs: eqs. 23.1, 23.2, 23.6 and 6.2 written out."""
    batch, tokens, d_model = x.shape
    out = torch.zeros(batch, tokens, d_model, dtype=torch.float64)
    pos = torch.arange(tokens)
    q_c, q_r = queries(x, w, pos)
    c, k_r = latents(x, w, pos)
    scale = 1 / math.sqrt(w.nope_dim + w.rope_dim)
    for b in range(batch):
        for h in range(w.heads):
            for i in range(tokens):
                z = torch.tensor(
                    [
                        (q_c[b, h, i] @ (c[b, j] @ w.w_uk[h]) + q_r[b, h, i] @ k_r[b, j]) * scale
                        for j in range(i + 1)
                    ]
                )
                a = torch.exp(z - z.max()) / torch.exp(z - z.max()).sum()
                o = sum(a[j] * (c[b, j] @ w.w_uv[h]) for j in range(i + 1))
                out[b, i] += o @ w.w_o[h]
    return out


shapes = st.fixed_dictionaries(
    {
        "heads": st.integers(1, 3),
        "d_q": st.sampled_from([None, 4, 8]),
        "d_c": st.integers(1, 8),
        "d_r": st.sampled_from([2, 4, 6]),
        "nope": st.integers(1, 5),
        "dv": st.integers(1, 5),
        "interleaved": st.booleans(),
    }
)


@settings(max_examples=25, deadline=None)
@given(shapes, st.integers(1, 2), st.integers(1, 5), st.integers(0, 10_000))
def test_naive_absorbed_and_brute_force_agree(shape, batch, tokens, seed):
    w = random_weights(seed, **shape)
    x = torch.randn(
        batch, tokens, 16, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    naive, absorbed = mla_naive(x, w), mla_absorbed(x, w)
    assert (naive - absorbed).abs().max() < 1e-12
    assert (naive - brute_force(x, w)).abs().max() < 1e-12


@settings(max_examples=15, deadline=None)
@given(shapes, st.integers(1, 4), st.integers(1, 4), st.integers(0, 10_000))
def test_decode_through_latent_cache(shape, prefill, steps, seed):
    w = random_weights(seed, **shape)
    total = prefill + steps
    x = torch.randn(
        2, total, 16, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    full = mla_naive(x, w)
    for path in (mla_naive, mla_absorbed):
        cache = LatentCache(shape["d_c"])
        pieces = [path(x[:, :prefill], w, cache)]
        pieces += [path(x[:, t : t + 1], w, cache) for t in range(prefill, total)]
        assert len(cache) == total
        assert cache.latents.shape == (2, total, shape["d_c"])
        assert (torch.cat(pieces, dim=1) - full).abs().max() < 1e-12


def test_cache_bytes_are_eq_23_3():
    w = random_weights(0, d_c=6, d_r=4).to(torch.float32)
    cache = LatentCache(6)
    x = torch.randn(3, 5, 16)
    mla_absorbed(x, w, cache)
    assert cache.nbytes() == 3 * 5 * (6 + 4) * 4


def test_cache_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="must agree"):
        LatentCache(4).append(torch.zeros(1, 3, 4), torch.zeros(1, 2, 2), torch.arange(3))


def test_rope_rows_matches_attnlib_rope_and_pairs_layout():
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    pos = torch.arange(5)
    cos, sin = rope_cos_sin(pos, 8)
    half = rope_rows(x, pos, 10000.0, interleaved=False)
    assert (half - apply_rope(x, cos.double(), sin.double())).abs().max() < 1e-6
    # interleaved: pair (2f, 2f+1) turns by p theta_f, as a complex number x_2f + i x_2f+1
    turned = rope_rows(x, pos, 10000.0, interleaved=True)
    theta = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    z = torch.complex(x[..., 0::2], x[..., 1::2]) * torch.exp(1j * pos[:, None] * theta)
    assert (turned - torch.cat((z.real, z.imag), dim=-1)).abs().max() < 1e-12


def test_absorption_identity_and_fold():
    w = random_weights(3)
    q_c = torch.randn(1, 2, 4, 4, dtype=torch.float64)
    q_r = torch.randn(1, 2, 4, 4, dtype=torch.float64)
    c = torch.randn(1, 7, 6, dtype=torch.float64)
    k_r = torch.randn(1, 7, 4, dtype=torch.float64)
    k, v = expand(c, k_r, w)
    q_full = torch.cat((q_c, q_r), dim=-1)
    lat = torch.cat((c, k_r), dim=-1)[:, None]
    assert (
        q_full @ k.transpose(-2, -1) - absorbed_query(q_c, q_r, w) @ lat.transpose(-2, -1)
    ).abs().max() < 1e-12
    a = torch.softmax(torch.randn(1, 2, 4, 7, dtype=torch.float64), -1)
    direct = torch.einsum("bhts,bhsd,hdm->btm", a, v, w.w_o)
    folded = torch.einsum("bhts,bsc,hcm->btm", a, c, folded_output(w))
    assert (direct - folded).abs().max() < 1e-12


def test_rope_before_absorption_is_wrong_except_at_position_zero():
    w = random_weights(5, nope=4)
    x = torch.randn(1, 9, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    true, absorbed = rope_before_absorption(x, w)
    error = (true - absorbed).abs()
    assert error[0, 0, 0] < 1e-12  # query and key at position 0: no turn, nothing to break
    assert error.max() > 0.1 * true.abs().max()


# ------------------------------------------------------------------ the real layer

transformers = pytest.importorskip("transformers")
from attnlib.lab import deepseek  # noqa: E402


@settings(max_examples=6, deadline=None)
@given(
    st.fixed_dictionaries(
        {
            "num_attention_heads": st.integers(1, 3),
            "q_lora_rank": st.sampled_from([None, 8, 16]),
            "kv_lora_rank": st.integers(2, 12),
            "qk_rope_head_dim": st.sampled_from([2, 4, 8]),
            "qk_nope_head_dim": st.integers(2, 8),
            "v_head_dim": st.integers(2, 8),
            "rope_interleave": st.booleans(),
        }
    ),
    st.integers(0, 1000),
)
def test_matches_deepseek_v3_attention(geometry, seed):
    layer = deepseek.random_layer(seed, hidden_size=32, **geometry)
    cases = deepseek.run_cases(layer, tokens=8, prefill=5, seed=seed)
    assert set(cases) == {
        f"{case}, {path}"
        for case in ("prefill", "decode", "padding")
        for path in ("naive", "absorbed")
    }
    assert max(cases.values()) < deepseek.TOLERANCE, cases


def test_a_wrong_weight_is_caught():
    layer = deepseek.random_layer(0)
    with torch.no_grad():
        layer.kv_a_layernorm.weight.mul_(1.5)  # the layer changes, our copy of it does not
    w = deepseek.weights_of(deepseek.random_layer(0))
    x = torch.randn(1, 5, 128)
    pos = torch.arange(5).expand(1, 5)
    from attnlib.lab.qwen3 import causal_mask

    ref = deepseek.layer_forward(layer, x, pos, causal_mask(1, 5, 5, torch.float32))
    assert (mla_naive(x, w) - ref).abs().max() > 100 * deepseek.TOLERANCE


def test_bytes_per_token_from_configs():
    assert deepseek.cache_bytes_per_token(deepseek.DEEPSEEK_V3) == {"numbers": 576, "bytes": 1152}
    assert deepseek.cache_bytes_per_token(deepseek.QWEN3_0_6B) == {"numbers": 2048, "bytes": 4096}
