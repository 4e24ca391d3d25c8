"""Causal linear attention (chapter 25): three forms of one function, and their costs."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlib.linear_attention import (
    crossover_length,
    decode_state_bytes,
    elu_feature_map,
    linear_attention_chunked,
    linear_attention_flops,
    linear_attention_quadratic,
    linear_attention_recurrent,
)


def _draw(seed, b, h, t, d, dv):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, h, t, d, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, torch.randn(b, h, t, dv, generator=gen, dtype=torch.float64)


def _brute_force(q, k, v):
    """Each output row from its own sums over j <= i, in plain Python loops over i and j."""
    fq, fk = elu_feature_map(q), elu_feature_map(k)
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    for i in range(q.shape[2]):
        sims = [(fq[:, :, i] * fk[:, :, j]).sum(-1, keepdim=True) for j in range(i + 1)]
        num = sum(s * v[:, :, j] for j, s in enumerate(sims))
        out[:, :, i] = num / sum(sims)
    return out


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    t=st.integers(1, 24),
    d=st.integers(1, 8),
    dv=st.integers(1, 8),
    chunk=st.integers(1, 30),
    seed=st.integers(0, 2**16),
)
def test_three_forms_agree_in_float64(b, h, t, d, dv, chunk, seed):
    q, k, v = _draw(seed, b, h, t, d, dv)
    reference = _brute_force(q, k, v)
    for out in (
        linear_attention_quadratic(q, k, v),
        linear_attention_recurrent(q, k, v),
        linear_attention_chunked(q, k, v, chunk=chunk),
    ):
        assert out.shape == (b, h, t, dv)
        assert torch.allclose(out, reference, atol=1e-12, rtol=0)


def test_feature_map_is_positive_and_the_first_row_copies_its_value():
    q, k, v = _draw(0, 1, 1, 9, 4, 3)
    assert (elu_feature_map(torch.linspace(-30, 30, 101, dtype=torch.float64)) > 0).all()
    assert torch.allclose(linear_attention_recurrent(q, k, v)[:, :, 0], v[:, :, 0], atol=1e-15)


def test_chunked_gradients_equal_the_quadratic_forms():
    q, k, v = (x.requires_grad_() for x in _draw(3, 1, 2, 11, 4, 5))
    weight = torch.randn(
        1, 2, 11, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64
    )
    grads = []
    for fn in (linear_attention_quadratic, lambda *a: linear_attention_chunked(*a, chunk=4)):
        grads.append(torch.autograd.grad((fn(q, k, v) * weight).sum(), (q, k, v)))
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(
        lambda *a: linear_attention_chunked(*a, chunk=3),
        tuple(x.detach()[:, :, :6].requires_grad_() for x in (q, k, v)),
    )


def test_flops_equations():
    t, d, dv = 4096, 64, 64
    assert linear_attention_flops(t, d, dv, "quadratic") == 2 * t * t * (d + dv)
    assert linear_attention_flops(t, d, dv, "recurrent") == 4 * t * d * (dv + 1)
    chunked = linear_attention_flops(t, d, dv, "chunked", chunk=64)
    assert chunked == 2 * t * 64 * (d + dv) + 4 * t * d * (dv + 1)
    # quadratic / recurrent grows like T: doubling T doubles the ratio
    ratio = [
        linear_attention_flops(n, d, dv, "quadratic")
        / linear_attention_flops(n, d, dv, "recurrent")
        for n in (1024, 2048)
    ]
    assert ratio[1] == pytest.approx(2 * ratio[0])
    with pytest.raises(ValueError, match="form must be"):
        linear_attention_flops(t, d, dv, "cubic")
    with pytest.raises(ValueError, match="chunk must be"):
        linear_attention_chunked(*_draw(0, 1, 1, 4, 2, 2), chunk=0)


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (16, 32), (3, 5)])
def test_crossover_is_the_first_length_where_the_cache_is_larger(d, dv):
    s = crossover_length(d, dv)
    state = decode_state_bytes(d, dv, bytes_per_number=1)
    assert s * (d + dv) > state >= (s - 1) * (d + dv)
    assert decode_state_bytes(d, dv, 2) == 2 * (d * dv + d)


# What a matrix state recalls (attnlib.lab.recall): eq. (25.7) against the measurement.


def test_stored_recall_matches_the_crosstalk_estimate():
    from attnlib.lab.recall import crosstalk_estimate, stored_recall

    for n, d in [(8, 64), (32, 64), (128, 64), (16, 16), (64, 32)]:
        assert abs(stored_recall(n, d, "linear") - crosstalk_estimate(n, d)) < 0.03, (n, d)
        assert stored_recall(n, d, "softmax") > 0.99
    # the delta rule, repeated, is least squares: exact below D pairs, not above
    assert stored_recall(16, 32, "delta", passes=16) > 0.999
    assert stored_recall(64, 32, "delta", passes=16) < 0.8
    assert crosstalk_estimate(1, 8) == 1.0
    with pytest.raises(ValueError, match="memory must be"):
        stored_recall(4, 4, "cache")


def test_linear_memory_read_out_is_value_plus_crosstalk():
    """k_i sum_j k_j^T v_j = v_i + sum_{j != i} (k_i . k_j) v_j, term by term."""
    from attnlib.lab.recall import random_store

    keys, values = random_store(5, 7, trials=1, seed=3)
    k, v = keys[0], values[0]
    read = k @ (k.T @ v)
    for i in range(5):
        cross = sum((k[i] @ k[j]) * v[j] for j in range(5) if j != i)
        assert torch.allclose(read[i], v[i] + cross, atol=1e-12, rtol=0)


def test_mqar_batches_ask_for_the_stored_values():
    from attnlib.lab.recall import mqar_batch

    tokens, targets = mqar_batch(6, 4, torch.Generator().manual_seed(0))
    assert tokens.shape == targets.shape == (4, 18)
    for row in range(4):
        pairs = dict(zip(tokens[row, 0:12:2].tolist(), tokens[row, 1:12:2].tolist()))
        assert len(pairs) == 6 and all(k < 64 <= v < 128 for k, v in pairs.items())
        assert (targets[row, :12] == -100).all()
        for key, want in zip(tokens[row, 12:].tolist(), targets[row, 12:].tolist()):
            assert pairs[key] == want


@pytest.mark.parametrize("mixer", ["softmax", "linear", "delta", "gated_delta"])
def test_every_mixer_is_causal(mixer):
    """A later token never changes an earlier position's logits."""
    from attnlib.lab.recall import RecallModel

    torch.manual_seed(0)
    model = RecallModel(mixer, width=8).double()
    tokens = torch.randint(128, (2, 12), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 5) % 128
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.allclose(a[:, :7], b[:, :7], atol=1e-12, rtol=0)
    assert not torch.allclose(a[:, 7:], b[:, 7:])
