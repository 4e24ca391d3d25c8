"""causal_attention's `sinks` (eq. 24.7) against gpt-oss's GptOssAttention (full and sliding
layers), a float64 brute force with an explicit extra column, and autograd."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlib.attention import attention_weights, causal_attention

lc = pytest.importorskip("attnlib.lab.long_context")


@pytest.mark.parametrize("seed, window, length", [(0, 4, 12), (1, 3, 16), (2, 8, 9)])
def test_sinks_equal_gpt_oss_with_and_without_window(seed, window, length):
    sliding, full = lc.gptoss_check(seed, window, length)
    assert sliding <= 1e-6 and full <= 1e-6


@settings(max_examples=40, deadline=None)
@given(
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2)]),
    queries=st.integers(1, 6),
    extra=st.integers(0, 4),
    seed=st.integers(0, 2**20),
)
def test_sink_is_an_extra_column_then_dropped(heads, queries, extra, seed):
    hq, hkv = heads
    g = torch.Generator().manual_seed(seed)
    keys = queries + extra
    q = torch.randn(1, hq, queries, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, hkv, keys, 4, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(hq, generator=g, dtype=torch.float64) * 3
    got = causal_attention(q, k, v, sinks=sinks)
    rep = hq // hkv
    for h in range(hq):
        for i in range(queries):
            seen = extra + i + 1
            z = q[0, h, i] @ k[0, h // rep, :seen].T / 2.0
            a = torch.softmax(torch.cat((z, sinks[h : h + 1])), 0)[:-1]
            torch.testing.assert_close(got[0, h, i], a @ v[0, h // rep, :seen])


def test_rows_sum_to_less_than_one_and_a_blind_row_outputs_zero():
    q = torch.zeros(1, 2, 3, 4)
    sinks = torch.tensor([0.0, 5.0])
    weights = attention_weights(q, q, sinks=sinks)
    sums = weights.sum(-1)  # equal scores: row i spreads 1/(i+2) over i+1 keys and the sink
    want = torch.tensor([[1 / 2, 2 / 3, 3 / 4]]) * torch.ones(2, 1)
    want[1] = torch.tensor([1, 2, 3]) / (torch.tensor([1, 2, 3]) + torch.e**5)
    torch.testing.assert_close(sums[0], want, rtol=1e-6, atol=0)
    blind = torch.zeros(1, 2, 3, 3, dtype=torch.bool)
    out = causal_attention(
        torch.randn(1, 2, 3, 4), q, torch.randn(1, 2, 3, 4), allowed=blind, sinks=sinks
    )
    assert out.abs().max() == 0


def test_sinks_get_gradients_like_autograd_of_the_brute_force():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 4, 4, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(2, generator=g, dtype=torch.float64, requires_grad=True)
    ours = torch.autograd.grad(causal_attention(q, k, v, sinks=sinks).sum(), sinks)[0]
    s2 = sinks.detach().clone().requires_grad_()
    z = (q @ k.transpose(-1, -2) / 2).masked_fill(~torch.ones(4, 4).tril().bool(), -torch.inf)
    a = torch.softmax(torch.cat((z, s2.view(1, 2, 1, 1).expand(1, 2, 4, 1)), -1), -1)
    want = torch.autograd.grad((a[..., :-1] @ v).sum(), s2)[0]
    torch.testing.assert_close(ours, want)


def test_no_sinks_keeps_the_old_result_and_bad_sinks_are_refused():
    q = torch.randn(1, 4, 5, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(causal_attention(q, q, q), causal_attention(q, q, q, sinks=None))
    with pytest.raises(ValueError, match="sinks"):
        causal_attention(q, q, q, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="sinks"):
        causal_attention(q, q, q, sinks=torch.zeros(4), fused=True)


@pytest.mark.parametrize("kind", ["rope", "alibi", "nope"])
def test_the_patterns_measured_are_those_of_the_models_own_pass(kind):
    """position_patterns recomputes the weights by hand: its pass must give the model's logits."""
    model, setup, _ = lc.load_length_model(kind)
    tokens = torch.randint(setup.vocab, (4, 48), generator=torch.Generator().manual_seed(0))
    patterns, logits = lc.position_patterns(model, tokens, logits=True)
    torch.testing.assert_close(logits, model(tokens), atol=1e-4, rtol=1e-4)
    assert len(patterns) == 2 and patterns[0].shape == (4, setup.heads, 48, 48)
    torch.testing.assert_close(patterns[1].sum(-1), torch.ones(4, setup.heads, 48))


def test_no_book_model_has_a_sink():
    """The chapter's claim: no head of a trained copy-task model puts half its weight on
    token 0 (the language model is measured in the chapter itself)."""
    for name, (share, _) in lc.copy_task_first_token().items():
        assert share.max() < 0.5, name
