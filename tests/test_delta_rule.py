"""The delta rule and the gated delta rule (chapter 25): recurrent and chunked forms against a
brute-force float64 reference, against transformers' Qwen3-Next functions and its layer."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlib.delta_rule import (
    delta_rule_chunked,
    delta_rule_recurrent,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)


def _draw(seed, b, h, t, d, dv, low=0.3):
    """q, unit k, v, alpha in [low, 1], eta in (0, 1), and an initial state, in float64."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=gen, dtype=torch.float64)
    k = F.normalize(torch.randn(b, h, t, d, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(b, h, t, dv, generator=gen, dtype=torch.float64)
    alpha = low + (1 - low) * torch.rand(b, h, t, generator=gen, dtype=torch.float64)
    eta = torch.rand(b, h, t, generator=gen, dtype=torch.float64)
    state = torch.randn(b, h, d, dv, generator=gen, dtype=torch.float64)
    return q, k, v, alpha, eta, state


def _brute_force(q, k, v, alpha, eta, state):
    """Eq. (25.9) as matrices: Omega_i = alpha_i (I - eta_i k_i^T k_i) Omega_{i-1}
    + eta_i k_i^T v_i, one sequence and head at a time; O_i = q_i Omega_i."""
    b, h, t, d = q.shape
    out = torch.empty(b, h, t, v.shape[-1], dtype=q.dtype)
    final = torch.empty_like(state)
    for n in range(b):
        for g in range(h):
            omega = state[n, g].clone()
            for i in range(t):
                key = k[n, g, i : i + 1]  # a row, [1, D]
                forget = torch.eye(d, dtype=q.dtype) - eta[n, g, i] * key.T @ key
                omega = alpha[n, g, i] * forget @ omega + eta[n, g, i] * key.T @ v[n, g, i : i + 1]
                out[n, g, i] = q[n, g, i] @ omega
            final[n, g] = omega
    return out, final


@settings(max_examples=50, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 2),
    t=st.integers(1, 20),
    d=st.integers(1, 6),
    dv=st.integers(1, 6),
    chunk=st.integers(1, 24),
    start=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_recurrent_and_chunked_equal_the_brute_force(b, h, t, d, dv, chunk, start, seed):
    q, k, v, alpha, eta, state = _draw(seed, b, h, t, d, dv)
    state = state if start else torch.zeros_like(state)
    want_out, want_state = _brute_force(q, k, v, alpha, eta, state)
    for out, final in (
        gated_delta_rule_recurrent(q, k, v, alpha, eta, initial_state=state),
        gated_delta_rule_chunked(q, k, v, alpha, eta, chunk=chunk, initial_state=state),
    ):
        assert torch.allclose(out, want_out, atol=1e-12, rtol=0)
        assert torch.allclose(final, want_state, atol=1e-12, rtol=0)
    ones = torch.ones_like(alpha)
    want_out, want_state = _brute_force(q, k, v, ones, eta, state)
    for out, final in (
        delta_rule_recurrent(q, k, v, eta, initial_state=state),
        delta_rule_chunked(q, k, v, eta, chunk=chunk, initial_state=state),
    ):
        assert torch.allclose(out, want_out, atol=1e-12, rtol=0)
        assert torch.allclose(final, want_state, atol=1e-12, rtol=0)


def test_the_delta_rule_is_one_gradient_step():
    """Eq. (25.8): Omega - eta d/dOmega |k Omega - v|^2 / 2, the gradient taken by autograd."""
    q, k, v, _, eta, state = _draw(1, 1, 1, 1, 5, 4)
    omega = state[0, 0].clone().requires_grad_()
    loss = 0.5 * ((k[0, 0] @ omega - v[0, 0]) ** 2).sum()
    (grad,) = torch.autograd.grad(loss, omega)
    _, final = delta_rule_recurrent(q, k, v, eta, initial_state=state)
    assert torch.allclose(final[0, 0], state[0, 0] - eta[0, 0, 0] * grad, atol=1e-14, rtol=0)
    # eta = 1 and a unit key: the pair is then recalled exactly
    _, final = delta_rule_recurrent(q, k, v, torch.ones_like(eta), initial_state=state)
    assert torch.allclose(k[0, 0] @ final[0, 0], v[0, 0], atol=1e-14, rtol=0)


def test_chunked_gradients_equal_the_recurrent_ones():
    tensors = [x.requires_grad_() for x in _draw(2, 1, 2, 9, 4, 3)]
    weight = torch.randn(
        1, 2, 9, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64
    )
    grads = []
    for fn in (
        gated_delta_rule_recurrent,
        lambda *a, **kw: gated_delta_rule_chunked(*a, chunk=4, **kw),
    ):
        out, final = fn(*tensors[:5], initial_state=tensors[5])
        grads.append(torch.autograd.grad((out * weight).sum() + final.sum(), tensors))
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)


def test_errors():
    with pytest.raises(ValueError, match="chunk must be"):
        gated_delta_rule_chunked(*_draw(0, 1, 1, 3, 2, 2)[:5], chunk=0)


# transformers' Qwen3-Next: the two torch functions and the whole layer.

pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


@pytest.mark.parametrize("t,chunk", [(1, 64), (7, 64), (70, 64), (33, 16)])
def test_equal_to_transformers_functions(t, chunk):
    from attnlib.lab.qwen3_next import hf_gated_delta_rule

    q, k, v, alpha, eta, _ = _draw(5 + t, 2, 3, t, 16, 8, low=0.5)
    raw_k = k * torch.rand(
        2, 3, t, 1, generator=torch.Generator().manual_seed(t), dtype=torch.float64
    ).add(0.5)
    unit_q = (
        F.normalize(q, dim=-1, eps=0) / 16**0.5
    )  # what use_qk_l2norm_in_kernel does, then 1/sqrt(D)
    want = gated_delta_rule_recurrent(unit_q, F.normalize(raw_k, dim=-1), v, alpha, eta)
    got_r = hf_gated_delta_rule("recurrent", q, raw_k, v, alpha, eta)
    got_c = hf_gated_delta_rule("chunk", q, raw_k, v, alpha, eta, chunk=chunk)
    for got in (got_r, got_c):
        for a, b in zip(got, want):
            assert a.shape == b.shape
            assert torch.allclose(a, b, atol=2e-5, rtol=1e-5), (a - b).abs().max()
    mine = gated_delta_rule_chunked(unit_q, F.normalize(raw_k, dim=-1), v, alpha, eta, chunk=chunk)
    assert torch.allclose(mine[0], want[0], atol=1e-12, rtol=0)


@pytest.mark.parametrize("t", [1, 5, 70])
def test_equal_to_the_qwen3_next_layer(t):
    from attnlib.lab.qwen3_next import (
        gated_deltanet_by_hand,
        hf_gated_deltanet,
        run_hf,
        small_config,
    )

    layer = hf_gated_deltanet(small_config(), seed=t)
    x = torch.randn(2, t, 64, generator=torch.Generator().manual_seed(t), dtype=torch.float64)
    want = run_hf(layer, x)
    for chunk in (64, 8):
        got = gated_deltanet_by_hand(layer, x, chunk=chunk)
        assert got.shape == want.shape == (2, t, 64)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    # a layer whose output is not negligible, so the tolerance above means something
    assert want.abs().max() > 1e-2


def test_decode_step_bytes_of_the_qwen3_next_plan():
    from transformers import Qwen3NextConfig

    from attnlib.lab.qwen3_next import decode_step_bytes, hybrid_layout

    config = Qwen3NextConfig()
    assert hybrid_layout(config) == {"linear_attention": 36, "full_attention": 12}
    counts = decode_step_bytes(config, tokens=32768)
    kv = 2 * 2 * 256 * 32768 * 2  # K and V, 2 KV heads of 256, bfloat16 (eq. 10.1)
    state = 2 * (32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128))  # eq. 25.5 and the conv
    assert counts == {
        "per_attention_layer": kv,
        "per_linear_layer": state,
        "hybrid": 12 * kv + 36 * state,
        "all_attention": 48 * kv,
    }
