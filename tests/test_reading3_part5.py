"""Part V after its third reading: the bracket head's closers split by distance and nesting, the
loss at the query the bracket score uses, Elhage et al.'s copying statistic beside the book's
variant, and chapter 20's readings (composition scores, patching one input) on chapter 19's
Qwen3 model. Each against an independent reference: loops over the tokens, numpy's eigenvalues,
the model's own linear layers, and the model run without a patch.
"""

import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnlib.figures import head_viewer  # noqa: E402
from attnlib.lab import circuits, lm  # noqa: E402
from attnlib.lab import lm_heads as heads  # noqa: E402

TOKENS = ["f", "(", "a", "Ġ[", "1", "]", ",", "Ġ(", "b", ")", ")", "Ġ{", "}", "x", "()", ")"]


def _causal_weights(batch, tokens, seed):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, tokens, tokens, generator=generator, dtype=torch.float64)
    hidden = torch.ones(tokens, tokens, dtype=torch.bool).triu(1)
    return scores.masked_fill(hidden, -math.inf).softmax(-1)


@pytest.fixture(scope="module")
def loaded():
    torch.manual_seed(0)
    return lm.load()


@pytest.fixture(scope="module")
def repeats():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(lm.CHECKPOINT / "repeats").eval()


# ---- chapter 19: the bracket head ------------------------------------------------------------


def test_bracket_breakdown_against_loops():
    pairs = heads.bracket_pairs(TOKENS)
    assert pairs == [(5, 3), (9, 7), (10, 1), (12, 11)]  # '()' and the last ')' pair nothing
    weights = _causal_weights(2, len(TOKENS), seed=3)
    for row in range(2):
        weights[row, 10, 7] = 5.0  # closer 10: largest weight on the inner opener
        weights[row, 12, 11] = 5.0  # closer 12: on its own opener, the nearest bracket
    found = heads.bracket_breakdown(weights, [TOKENS, TOKENS])
    expected = {name: [] for name in found}
    for row in range(2):
        for query, key in pairs:
            best = max(range(len(TOKENS)), key=lambda j: weights[row, query, j])
            brackets = [j for j in range(query) if any(c in "()[]{}" for c in TOKENS[j])]
            expected["distance"].append(query - key)
            expected["nested"].append(any("(" in t or "[" in t for t in TOKENS[key + 1 : query]))
            expected["on_opener"].append(best == key)
            expected["on_nearest"].append(best == brackets[-1])
    for name, values in expected.items():
        assert found[name].tolist() == values, name
    assert found["nested"].tolist() == [False, False, True, False] * 2
    assert found["on_opener"][[3, 7]].all() and not found["on_opener"][[2, 6]].any()


def test_closer_queries_are_the_closing_targets_one_token_later(loaded):
    _, tokenizer = loaded
    ids = heads.windows(tokenizer, lm.heldout_text(), 128, 24)
    targets, queries = heads.closing_targets(tokenizer, ids), heads.closer_queries(tokenizer, ids)
    assert targets.shape == queries.shape == (24, 127)
    assert torch.equal(queries[:, 1:], targets[:, :-1])
    for row in range(24):
        tokens = tokenizer.convert_ids_to_tokens(ids[row])
        loop = [tokens[i].strip("Ġ") in (")", "]", "}") for i in range(127)]
        assert queries[row].tolist() == loop
    assert queries.any()


def test_ablation_groups_and_other_against_the_hook(loaded):
    model, tokenizer = loaded
    ids = heads.windows(tokenizer, lm.heldout_text(), 64, 4)
    repeated = heads.repeated_tokens(tokenizer, half=8, rows=2, seed=1)
    groups = {"a": heads.closing_targets(tokenizer, ids), "b": heads.closer_queries(tokenizer, ids)}
    groups["a"][0, :3] = True  # make sure both groups are not empty
    groups["b"][1, :3] = True
    row = heads.ablation(model, 1, 0, ids, groups, repeated, 8)
    base, base_rep = heads.per_token_loss(model, ids), heads.per_token_loss(model, repeated)
    with heads.ablated(model, 1, 0):
        change = heads.per_token_loss(model, ids) - base
        change_rep = heads.per_token_loss(model, repeated) - base_rep
    rest = ~(groups["a"] | groups["b"])
    assert list(row) == ["other", "a", "b", "copy 1", "copy 2"]
    assert row["other"] == pytest.approx(float(change[rest].mean()), abs=1e-7)
    assert row["a"] == pytest.approx(float(change[groups["a"]].mean()), abs=1e-7)
    assert row["b"] == pytest.approx(float(change[groups["b"]].mean()), abs=1e-7)
    assert row["copy 1"] == pytest.approx(float(change_rep[:, :7].mean()), abs=1e-7)
    assert row["copy 2"] == pytest.approx(float(change_rep[:, 8:].mean()), abs=1e-7)


def test_bracket_split_figure_counts_every_closer():
    weights = _causal_weights(1, len(TOKENS), seed=4)
    split = heads.bracket_breakdown(weights, [TOKENS])
    fig = head_viewer.bracket_split(split)
    bars = fig.axes[0].patches
    heights = [int(bar.get_height()) for bar in bars]
    bins = len(heights) // 3
    assert sum(heights[:bins]) == len(split["distance"])  # the first series: every closer
    assert sum(heights[bins : 2 * bins]) == int(split["on_opener"].sum())
    assert sum(heights[2 * bins :]) == int(split["on_nearest"].sum())


def test_layers_are_labelled_from_one():
    weights = [torch.rand(2, 3, 3) for _ in range(2)]
    viewer = head_viewer.head_viewer(weights, ["a", "b", "c"])
    if hasattr(viewer, "summary"):
        assert viewer.summary == "slider over L1H0..L2H1: 4 views"
    grids = {"x": torch.rand(4, 4).numpy(), "y": torch.rand(4, 4).numpy()}
    fig = head_viewer.score_grids(grids, {"x": "", "y": ""})
    labels = [tick.get_text() for tick in fig.axes[0].get_yticklabels()]
    assert labels == ["1", "2", "3", "4"]


# ---- chapter 20: the copying statistics -------------------------------------------------------


def numpy_copy(matrix):
    """Elhage et al.'s statistic, eigenvalue by eigenvalue, with numpy."""
    eigenvalues = np.linalg.eigvals(matrix.double().numpy())
    return sum(eigenvalues).real / sum(abs(x) for x in eigenvalues)


@pytest.mark.parametrize("seed", range(4))
def test_eigenvalue_copying_matches_numpy(seed):
    generator = torch.Generator().manual_seed(seed)
    matrix = torch.randn(12, 12, generator=generator)
    assert circuits.eigenvalue_copying(matrix) == pytest.approx(numpy_copy(matrix), abs=1e-9)
    assert -1.0 <= circuits.eigenvalue_copying(matrix) <= 1.0


def test_the_two_statistics_at_their_ends_and_their_blind_spot():
    eye = torch.eye(6)
    assert circuits.eigenvalue_copying(eye) == 1.0 and circuits.copying_score(eye) == 1.0
    assert circuits.eigenvalue_copying(-eye) == -1.0 and circuits.copying_score(-eye) == 0.0
    assert math.isnan(circuits.eigenvalue_copying(0 * eye))
    mixing = eye + 3 * torch.ones(6, 6).tril(-1)  # every eigenvalue 1, much off-diagonal mass
    assert circuits.eigenvalue_copying(mixing) == pytest.approx(1.0, abs=1e-12)
    assert circuits.copying_score(mixing) == pytest.approx(1.0, abs=1e-12)
    shift = torch.eye(32).roll(1, dims=1)  # a cyclic shift: trace 0
    assert abs(circuits.eigenvalue_copying(shift)) < 1e-9


def test_the_trained_previous_token_head_anti_copies_faintly():
    model = circuits.load_run(0)[600]
    tables = [circuits.ov_circuit(model, layer, head) for layer, head in ((0, 0), (1, 0), (1, 1))]
    previous, *inductions = tables
    assert circuits.eigenvalue_copying(previous) < -0.9
    assert all(circuits.eigenvalue_copying(t) > 0.9 for t in inductions)
    assert 4 * torch.linalg.norm(previous) < min(torch.linalg.norm(t) for t in inductions)


# ---- chapter 20's readings on chapter 19's model ----------------------------------------------


def test_head_circuits_are_the_bilinear_forms_of_the_model_layers(repeats):
    config = repeats.config
    generator = torch.Generator().manual_seed(5)
    x, y = (torch.randn(3, config.hidden_size, generator=generator) for _ in range(2))
    dim, group = config.head_dim, config.num_attention_heads // config.num_key_value_heads
    for layer, head in ((1, 3), (3, 2), (0, 0)):
        block = repeats.model.layers[layer]
        attention, gain = block.self_attn, block.input_layernorm.weight
        w_qk, w_ov = heads.head_circuits(repeats, layer, head)
        with torch.no_grad():
            rows, kv = slice(head * dim, (head + 1) * dim), head // group
            kv_rows = slice(kv * dim, (kv + 1) * dim)
            q = attention.q_proj(x * gain)[:, rows] * attention.q_norm.weight  # [3, D]
            k = attention.k_proj(y * gain)[:, kv_rows] * attention.k_norm.weight
            v = attention.v_proj(y * gain)[:, kv_rows]
            written = v @ attention.o_proj.weight[:, rows].T  # [3, d_model]
        assert torch.allclose(x @ w_qk @ y.T, q @ k.T, atol=1e-4)
        assert torch.allclose(y @ w_ov.T, written, atol=1e-5)


def test_lm_composition_is_eq_19_5_of_those_matrices(repeats):
    tables = heads.composition(repeats, (1, 3), 3)
    write = heads.head_circuits(repeats, 1, 3)[1].double().numpy()
    for head in range(repeats.config.num_attention_heads):
        qk, ov = (m.double().numpy() for m in heads.head_circuits(repeats, 3, head))
        for name, reader in (("K", qk), ("Q", qk.T), ("V", ov)):
            product = np.linalg.norm(reader @ write)
            expected = product / (np.linalg.norm(reader) * np.linalg.norm(write))
            assert float(tables[name][head]) == pytest.approx(expected, rel=1e-9)


def test_head_write_is_the_head_slice_of_o_proj(repeats, loaded):
    _, tokenizer = loaded
    ids = heads.repeated_tokens(tokenizer, half=6, rows=2, seed=2)
    writes = [heads.head_write(repeats, ids, 1, h) for h in range(4)]
    captured = {}
    o_proj = repeats.model.layers[1].self_attn.o_proj
    handle = o_proj.register_forward_hook(lambda m, a, out: captured.setdefault("out", out))
    try:
        with torch.no_grad():
            repeats(input_ids=ids)
    finally:
        handle.remove()
    assert torch.allclose(sum(writes), captured["out"], atol=1e-5)  # o_proj has no bias


def test_an_identity_patch_changes_nothing_and_a_key_patch_only_the_keys(repeats, loaded):
    _, tokenizer = loaded
    ids = heads.repeated_tokens(tokenizer, half=10, rows=3, seed=3)
    source, reader = (1, 3), 3
    write = heads.head_write(repeats, ids, *source)
    base = heads.per_token_loss(repeats, ids)
    same = heads.patched_loss(repeats, ids, source, write, reader, ("query", "key", "value"))
    assert torch.allclose(same, base, atol=1e-6)
    assert torch.equal(heads.patched_loss(repeats, ids, source, write, reader), base)

    seen = {}
    attention = repeats.model.layers[reader].self_attn
    hooks = [
        getattr(attention, name).register_forward_hook(
            lambda m, a, out, name=name: seen.setdefault(name, []).append(out.clone())
        )
        for name in ("q_proj", "k_proj", "v_proj")
    ]
    try:
        heads.per_token_loss(repeats, ids)
        heads.patched_loss(repeats, ids, source, write.roll(1, 0), reader, ("key",))
    finally:
        for hook in hooks:
            hook.remove()
    # seen[name]: [unpatched, the head_write pass inside patched_loss, patched]
    assert torch.equal(seen["q_proj"][0], seen["q_proj"][-1])
    assert torch.equal(seen["v_proj"][0], seen["v_proj"][-1])
    assert not torch.allclose(seen["k_proj"][0], seen["k_proj"][-1])


def test_patching_table_rows_and_errors(repeats, loaded):
    _, tokenizer = loaded
    ids = heads.repeated_tokens(tokenizer, half=10, rows=4, seed=4)
    table = heads.patching_table(repeats, ids, 10, (1, 3), 3)
    expected = ["none"] + [f"{n} only, {r}" for n in heads.INPUTS for r in ("mean", "shuffled")]
    assert list(table) == expected + ["whole head, zero"]
    loss = heads.per_token_loss(repeats, ids)
    assert table["none"] == (float(loss[:, :9].mean()), float(loss[:, 10:].mean()))
    with pytest.raises(ValueError, match="must come after"):
        heads.patched_loss(repeats, ids, (2, 0), torch.zeros(1), 2, ("key",))
    with pytest.raises(ValueError, match="inputs must be among"):
        heads.patched_loss(repeats, ids, (1, 0), torch.zeros(1), 3, ("keys",))
