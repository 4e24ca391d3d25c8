"""Chapter 20's circuits: copying scores, composition scores, patching, the hand-built model.

The trained models are the runs shipped in attnlib/lab/induction_run (chapter 18's model and
training, seeds 0-3); one test retrains the first 50 steps of seed 0 and compares.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlib.lab import circuits, induction

SETUP = induction.Setup()


def float64_copying_score(matrix):
    """Eq. 20.3 with numpy's eigenvalues, one by one, as the reference."""
    import numpy as np

    eigenvalues = np.linalg.eigvals(matrix.double().numpy())
    total = sum(abs(x) for x in eigenvalues)
    return sum(abs(x) for x in eigenvalues if x.real > 0) / total


@pytest.fixture(scope="module")
def evaluation():
    return induction.task_batch(SETUP, 256, torch.Generator().manual_seed(999))


@pytest.fixture(scope="module")
def trained():
    return circuits.load_run(0)[SETUP.steps]


def test_copying_score_is_one_for_identity_and_zero_for_its_negative():
    for n in (1, 5, 32):
        assert circuits.copying_score(torch.eye(n)) == 1.0
        assert circuits.copying_score(-torch.eye(n)) == 0.0
    assert math.isnan(circuits.copying_score(torch.zeros(4, 4)))  # writes nothing


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 40), st.integers(0, 2**31 - 1))
def test_copying_score_matches_a_float64_reference(n, seed):
    matrix = torch.randn(n, n, generator=torch.Generator().manual_seed(seed))
    assert circuits.copying_score(matrix) == pytest.approx(float64_copying_score(matrix), 1e-9)
    scaled = circuits.copying_score(4.0 * matrix)  # a positive scale changes nothing
    assert scaled == pytest.approx(circuits.copying_score(matrix), abs=1e-9)


def test_copying_score_of_the_trained_heads(trained):
    """Eq. 20.3 on the full OV circuits of eq. 20.2, against the float64 reference."""
    for layer in range(2):
        for head in range(SETUP.heads):
            table = circuits.ov_circuit(trained, layer, head)
            reference = float64_copying_score(table)
            assert circuits.copying_score(table) == pytest.approx(reference, abs=1e-9)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 12), st.integers(1, 12), st.integers(1, 12), st.integers(0, 2**31 - 1))
def test_composition_score_is_its_formula_and_ignores_scale(rows, middle, cols, seed):
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(rows, middle, generator=generator, dtype=torch.float64)
    b = torch.randn(middle, cols, generator=generator, dtype=torch.float64)
    by_hand = math.sqrt(((a @ b) ** 2).sum()) / math.sqrt((a**2).sum() * (b**2).sum())
    score = circuits.composition_score(a, b)
    assert score == pytest.approx(by_hand, rel=1e-12)
    assert 0.0 <= score <= 1.0 + 1e-12
    for factor in (1e-3, 7.0, -2.5):
        assert circuits.composition_score(factor * a, b) == pytest.approx(score, rel=1e-12)
        assert circuits.composition_score(a, factor * b) == pytest.approx(score, rel=1e-12)


def test_head_weights_are_the_slices_the_forward_pass_uses(trained, evaluation):
    """W_Q, W_K of eq. 20.1 give the attention weights that the model computes."""
    tokens = evaluation.tokens[:4]
    first = induction.attention_patterns(trained, tokens)[0]  # [B, H, T, T]
    x = trained.embed(tokens) + trained.positions  # layer 1 reads the embeddings and P
    for head in range(SETUP.heads):
        scores = x @ circuits.qk_matrix(trained, 0, head) @ x.transpose(1, 2)
        width = SETUP.d_model // SETUP.heads
        causal = torch.ones(SETUP.length, SETUP.length, dtype=torch.bool).tril()
        weights = (scores / math.sqrt(width)).masked_fill(~causal, -math.inf).softmax(-1)
        assert torch.allclose(weights, first[:, head], atol=1e-5)


def test_unpatched_run_is_the_model_bit_for_bit(trained, evaluation):
    logits, write = circuits.patched_logits(trained, evaluation.tokens, (0, 0), None)
    assert torch.equal(logits, trained(evaluation.tokens))
    assert write.shape == (len(evaluation.tokens), SETUP.length, SETUP.d_model)


@pytest.mark.parametrize("reader", circuits.READERS)
def test_a_patch_into_an_input_the_head_does_not_feed_changes_no_bit(trained, evaluation, reader):
    """A layer-1 head does not feed layer 1's own inputs; a layer-2 head feeds no layer."""
    tokens = evaluation.tokens
    unpatched = circuits.copied_loss(trained(tokens), evaluation)
    noise = torch.randn(1, SETUP.length, SETUP.d_model, generator=torch.Generator().manual_seed(1))
    for head, into in (((0, 0), {(0, reader)}), ((1, 1), {(0, reader), (1, reader)})):
        logits = circuits.patched_logits(trained, tokens, head, noise, into)[0]
        assert circuits.copied_loss(logits, evaluation) == unpatched  # bit for bit


def test_zero_patch_everywhere_is_chapter_16s_ablation(trained, evaluation):
    table = circuits.patching_table(trained, evaluation)
    ablated = induction.evaluate(trained, evaluation, ablate={(0, 0)})[0]
    assert table["whole head, zero"] == pytest.approx(ablated, abs=1e-4)
    assert table["none"] == pytest.approx(induction.evaluate(trained, evaluation)[0], abs=1e-6)


def test_step_back_rotates_positions_back_by_one():
    d_model = 2 * circuits.PAIRS + 3 * SETUP.vocab
    positions = induction.sinusoidal_positions(SETUP.length, d_model)[:, : 2 * circuits.PAIRS]
    moved = positions[1:] @ circuits.step_back(d_model).T  # P_i -> P_(i-1), eq. 20.6
    assert torch.allclose(moved, positions[:-1], atol=1e-5)


@settings(max_examples=12, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.integers(4, 8),  # segment
    st.integers(16, 32),  # length
)
def test_the_hand_built_model_solves_the_task_over_seeds_and_lengths(seed, segment, length):
    """Copied-token loss below chapter 18's 0.4 ln V threshold at any length it was built for
    (T <= 32) and any segment, with no training; and a failure without repeats."""
    model = circuits.hand_built(SETUP)
    setup = SETUP._replace(length=length, segment=segment)
    data = induction.task_batch(setup, 64, torch.Generator().manual_seed(seed))
    copied, _ = induction.evaluate(model, data)
    assert copied < induction.Thresholds().two_below * math.log(SETUP.vocab)
    generator = torch.Generator().manual_seed(seed)
    fresh = torch.stack([torch.randperm(SETUP.vocab, generator=generator) for _ in range(16)])
    logits = model(fresh[:, :length])[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), fresh[:, 1:length])
    assert loss > math.log(SETUP.vocab)  # no repeat, nothing to copy


def test_the_hand_built_circuits():
    model = circuits.hand_built(SETUP)
    assert circuits.copying_score(circuits.ov_circuit(model, 1, 0)) == 1.0
    assert circuits.offset_peaks(model, 0) == list(range(1, SETUP.length))
    assert circuits.diagonal_peaks(model, 0, 0) == SETUP.vocab
    tables = circuits.composition_scores(model)
    assert tables["K"][0, 0] == pytest.approx(SETUP.vocab**-0.5, abs=1e-9)
    assert tables["Q"][0, 0] == 0.0 and tables["V"][0, 0] == 0.0


def test_random_composition_is_seeded():
    one = circuits.random_composition(32, 16, 20, torch.Generator().manual_seed(0))
    two = circuits.random_composition(32, 16, 20, torch.Generator().manual_seed(0))
    assert torch.equal(one, two) and 0.1 < float(one.mean()) < 0.3


@pytest.fixture(scope="module")
def random_largest():
    return float(circuits.random_composition(32, 16, 1000, torch.Generator().manual_seed(0)).max())


@pytest.mark.parametrize("seed", (0, *circuits.OTHER_SEEDS))
def test_the_circuit_claims_hold_for_every_shipped_seed(seed, random_largest):
    """The chapter's claims (circuits.Claims) on the chapter's run and on 3 other seeds."""
    model = circuits.load_run(seed)[SETUP.steps]
    data = induction.task_batch(SETUP, 512, torch.Generator().manual_seed(999))
    assert circuits.failed_circuit_claims(model, data, random_largest) == []


def test_an_untrained_model_fails_the_circuit_claims(random_largest):
    data = induction.task_batch(SETUP, 128, torch.Generator().manual_seed(999))
    failed = circuits.failed_circuit_claims(induction.make_model(0), data, random_largest)
    assert "K-composition" in failed and len(failed) >= 3, failed


def test_the_chapter_run_holds_chapter_16s_checkpoints():
    """Step 0 is make_model(0) untrained; retraining 50 steps lands on the saved step 50."""
    run = torch.load(circuits.RUN / "seed0.pt", weights_only=True)
    assert sorted(run) == list(circuits.CHECKPOINTS)
    untrained = induction.make_model(0, SETUP).state_dict()
    assert all(torch.equal(untrained[n], run[0][n]) for n in untrained)
    history = induction.train(
        induction.make_model(0, SETUP), SETUP, seed=100, steps=50, checkpoints=(50,)
    )
    for name, weight in run[50].items():
        assert torch.allclose(history.checkpoints[50][name], weight, atol=1e-4), name


@pytest.mark.parametrize("seed", circuits.OTHER_SEEDS)
def test_the_circuit_claims_hold_after_training_each_other_seed_afresh(seed, random_largest):
    """Chapter 18's training from seed s (about 10 s each on one thread), then the claims."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        state = circuits.train_run(seed, steps=(SETUP.steps,))[SETUP.steps]
    finally:
        torch.set_num_threads(threads)
    model = induction.make_model(seed, SETUP)
    model.load_state_dict(state)
    data = induction.task_batch(SETUP, 512, torch.Generator().manual_seed(999))
    assert circuits.failed_circuit_claims(model, data, random_largest) == []
