"""Chapter 18's lab (attnlib.lab.induction): the copy task, the model, its training, its probes.

The references are independent: explicit loops for the task and for the head scores of eq. 18.2,
a float64 head-by-head recomputation of eq. 18.1 through the brute-force attention of
tests/references.py, and PyTorch's SDPA for training. The learned claims are checked on a tiny
configuration, and the chapter's thresholds on models trained from seeds other than its own.
"""

import math

import pytest
import torch

from attnlib import tiled_attention
from attnlib.lab import induction
from attnlib.lab.induction import Setup
from tests.references import brute_force

TINY = Setup(vocab=16, length=20, segment=6, lr=3e-2, steps=400)  # trains in a few seconds
CHAPTER_SEEDS = (0, 100)  # the chapter's model seed and data seed
OTHER_SEEDS = (1, 2, 3)  # model seed s, data seed 100 + s


def test_copy_task_copies_a_segment_at_a_varying_offset():
    setup = Setup()
    data = induction.task_batch(setup, 256, torch.Generator().manual_seed(5))
    again = induction.task_batch(setup, 256, torch.Generator().manual_seed(5))
    assert all(torch.equal(a, b) for a, b in zip(data, again))  # seeded
    for row in range(256):
        source, target = int(data.source[row]), int(data.target[row])
        assert 0 <= source and source + setup.segment <= target
        assert target + setup.segment <= setup.length
        for j in range(setup.segment):
            assert data.tokens[row, target + j] == data.tokens[row, source + j]
        expected = [target <= t and t + 1 < target + setup.segment for t in range(setup.length - 1)]
        assert data.copied[row].tolist() == expected  # prediction t is of token t + 1
    assert len((data.target - data.source).unique()) >= 8
    with pytest.raises(ValueError, match="segment"):
        induction.copy_task(4, 10, 8, 6, torch.Generator())


def test_sinusoidal_positions_match_their_formula():
    table = induction.sinusoidal_positions(7, 6)
    for p in range(7):
        for i in range(3):
            angle = p / 10000 ** (2 * i / 6)
            assert table[p, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[p, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    with pytest.raises(ValueError, match="even"):
        induction.sinusoidal_positions(4, 5)


def reference_logits(model, tokens):
    """Eq. 18.1 in float64, head by head, with the brute-force attention of tests/references."""
    w = {name: p.detach().double() for name, p in model.named_parameters()}
    x = w["embed.weight"][tokens]  # [B, T, d]
    where = model.positions.double()[: tokens.shape[1]]
    d, heads = x.shape[-1], model.heads
    size, positions = d // heads, torch.arange(tokens.shape[1]).expand(len(tokens), -1)
    for layer in range(len(model.out)):
        w_q, w_k = w[f"query_key.{layer}.weight"].split(d)  # [d, d] each, [out, in]
        w_v, w_o = w[f"value.{layer}.weight"], w[f"out.{layer}.weight"]
        outputs = []
        for h in range(heads):
            block = slice(h * size, (h + 1) * size)  # head h owns these features (eq. 6.1)
            q = ((x + where) @ w_q[block].T)[:, None]  # [B, 1, T, Dh]
            k = ((x + where) @ w_k[block].T)[:, None]
            v = (x @ w_v[block].T)[:, None]
            outputs.append(brute_force(q, k, v, positions, positions)[:, 0])  # [B, T, Dh]
        x = x + torch.cat(outputs, -1) @ w_o.T  # eq. 6.2, then the residual add
    return x @ w["unembed.weight"].T  # [B, T, V]


def test_model_is_eq_16_1_with_any_attention():
    setup = Setup()
    tokens = induction.task_batch(setup, 3, torch.Generator().manual_seed(1)).tokens
    reference = reference_logits(induction.make_model(4, setup), tokens)
    for attention in (tiled_attention, induction.sdpa_attention):
        model = induction.make_model(4, setup, attention=attention)
        assert torch.allclose(model(tokens).double(), reference, atol=1e-5, rtol=0)


def test_ablating_every_head_leaves_the_direct_path_and_patterns_are_causal():
    setup = Setup()
    model = induction.make_model(2, setup)
    tokens = induction.task_batch(setup, 2, torch.Generator().manual_seed(3)).tokens
    every = {(layer, h) for layer in range(2) for h in range(setup.heads)}
    direct = model.unembed(model.embed(tokens))  # E W_U: no head adds anything
    assert torch.allclose(model(tokens, ablate=every), direct, atol=1e-6, rtol=0)
    assert not torch.allclose(model(tokens), direct, atol=1e-3)
    patterns = induction.attention_patterns(model, tokens)
    assert len(patterns) == 2 and patterns[0].shape == (2, setup.heads, 32, 32)
    for weights in patterns:
        assert torch.allclose(weights.sum(-1), torch.ones(2, setup.heads, 32))
        assert (weights.triu(1) == 0).all()  # no key after its query


def test_head_scores_match_explicit_loops():
    setup = Setup(length=12, segment=3)
    data = induction.task_batch(setup, 5, torch.Generator().manual_seed(7))
    scores = torch.randn(5, 3, 12, 12, generator=torch.Generator().manual_seed(8))
    weights = scores.masked_fill(torch.ones(12, 12).triu(1).bool(), -math.inf).softmax(-1)
    previous = induction.previous_token_score(weights)
    ind = induction.induction_score(weights, data)
    for h in range(3):
        entries = [weights[b, h, i, i - 1].item() for b in range(5) for i in range(1, 12)]
        assert previous[h].item() == pytest.approx(sum(entries) / len(entries), rel=1e-6)
        entries = []
        for b in range(5):
            offset = int(data.target[b] - data.source[b])
            for i in range(int(data.target[b]), int(data.target[b]) + setup.segment - 1):
                entries.append(weights[b, h, i, i - offset + 1].item())
        assert ind[h].item() == pytest.approx(sum(entries) / len(entries), rel=1e-6)


def test_training_through_tiled_attention_equals_sdpa_for_ten_steps():
    """The chapter's setup and seeds: equal losses and gradients at every one of 10 steps."""
    runs = {}
    for name, attention in (
        ("tiled", tiled_attention),
        ("sdpa", induction.sdpa_attention),
    ):
        record = runs[name] = []
        model = induction.make_model(CHAPTER_SEEDS[0], attention=attention)

        def keep(step, loss, model, record=record):
            record.append((loss.item(), [p.grad.clone() for p in model.parameters()]))

        induction.train(model, Setup(), CHAPTER_SEEDS[1], steps=10, on_step=keep)
    assert len(runs["tiled"]) == 10
    for (loss, grads), (their_loss, their_grads) in zip(runs["tiled"], runs["sdpa"]):
        assert loss == pytest.approx(their_loss, abs=1e-5)
        for grad, theirs in zip(grads, their_grads):
            assert (grad - theirs).abs().max() <= 1e-5 * theirs.abs().max()


def test_training_is_deterministic():
    histories = [
        induction.train(induction.make_model(0, TINY), TINY, seed=1, steps=20) for _ in range(2)
    ]
    assert histories[0].copied == histories[1].copied
    assert histories[0].other == histories[1].other


def test_tiny_model_shows_the_phase_change_and_both_heads():
    model = induction.make_model(0, TINY)
    history = induction.train(model, TINY, seed=100)
    copied = induction.smoothed(history.copied, 50)
    log_v = math.log(TINY.vocab)
    assert copied[0] > 0.9 * log_v and copied[-1] < 0.5 * log_v, copied  # the phase change
    assert min(induction.smoothed(history.other, 50)) > 0.95 * log_v  # random stays random
    data = induction.task_batch(TINY, 256, torch.Generator().manual_seed(9))
    first, second = induction.attention_patterns(model, data.tokens)
    assert induction.previous_token_score(first).max() > 0.5  # layer 1: previous-token head
    assert induction.induction_score(second, data).max() > 0.5  # layer 2: induction head


def test_untrained_models_fail_the_learned_claims():
    setup = Setup()
    data = induction.task_batch(setup, 64, torch.Generator().manual_seed(9))
    found = induction.evidence(induction.make_model(0), induction.make_model(0, layers=1), data)
    failed = induction.failed_claims(found, setup.vocab)
    assert {"2-layer copied loss", "previous-token head", "induction head"} <= set(failed)


@pytest.mark.parametrize("seed", OTHER_SEEDS)
def test_the_chapter_thresholds_hold_for_other_seeds(seed):
    """Chapter 18's claims (induction.Thresholds), for models trained as in the chapter."""
    setup = Setup()
    two = induction.make_model(seed, setup)
    induction.train(two, setup, seed=100 + seed)
    one = induction.make_model(seed, setup, layers=1)
    induction.train(one, setup, seed=100 + seed)
    data = induction.task_batch(setup, 512, torch.Generator().manual_seed(999))
    found = induction.evidence(two, one, data)
    assert induction.failed_claims(found, setup.vocab) == [], found


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="multiple of heads"):
        induction.AttentionOnly(8, 8, d_model=6, heads=4)
    model = induction.AttentionOnly(8, 8, d_model=4, heads=2)
    with pytest.raises(ValueError, match="T <= 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_previous_weight_by_position_matches_a_loop():
    setup = Setup()
    data = induction.task_batch(setup, 40, torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(8)
    weights = torch.rand(40, setup.length, setup.length, generator=gen)  # [B, T, T]
    in_copy, elsewhere = induction.previous_weight_by_position(weights, data)
    assert in_copy.isnan()[0] and elsewhere.isnan()[0]  # position 0 has no previous token
    for t in range(1, setup.length):
        inside = [b for b in range(40) if t < setup.length - 1 and bool(data.copied[b, t])]
        outside = [b for b in range(40) if b not in inside]
        for rows, found in ((inside, in_copy[t]), (outside, elsewhere[t])):
            if rows:
                expected = sum(float(weights[b, t, t - 1]) for b in rows) / len(rows)
                assert abs(float(found) - expected) < 1e-6
            else:
                assert found.isnan()
