"""The small language model of chapter 19: its checkpoint, attnlib's attention inside
transformers, the training command, the head scores and the errors on bad input."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnlib.lab import attention_interface, lm  # noqa: E402
from attnlib.lab import lm_heads as heads  # noqa: E402
from attnlib.lab.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def loaded():
    torch.manual_seed(0)
    return lm.load()


@pytest.fixture(scope="module")
def batch(loaded):
    """Two rows of 64 held-out tokens; the second left-padded by 5 tokens."""
    _, tokenizer = loaded
    ids = tokenizer(lm.heldout_text()[:4000], return_tensors="pt")["input_ids"][:, :128]
    ids = ids.view(2, 64)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    return ids, mask


def test_checkpoint_files_and_size():
    names = {path.name for path in lm.CHECKPOINT.iterdir()}
    assert set(lm.REQUIRED) | {"heldout.txt", "manifest.json", "loss_curve.csv"} <= names
    total = sum(path.stat().st_size for path in lm.CHECKPOINT.rglob("*") if path.is_file())
    assert total <= 20 * 2**20
    assert (lm.CHECKPOINT / "heldout.txt").stat().st_size <= 400_000
    manifest = lm.manifest()
    assert "PSF" in manifest["licence"] and manifest["train_files"] and manifest["heldout_files"]
    train, heldout = (
        {f[0] for f in manifest["train_files"]},
        {f[0] for f in manifest["heldout_files"]},
    )
    assert not train & heldout


def test_config_carries_what_transformers_4_51_reads():
    config = json.loads((lm.CHECKPOINT / "config.json").read_text())
    assert config["rope_theta"] == 10000.0 and config["torch_dtype"] == "float32"
    assert config["attn_implementation"] in ("sdpa", "eager")  # loads with no registration
    tokenizer_config = json.loads((lm.CHECKPOINT / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_loads_offline_in_a_fresh_process():
    script = (
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "from attnlib.lab.lm import CHECKPOINT\n"
        "m = AutoModelForCausalLM.from_pretrained(CHECKPOINT)\n"
        "t = AutoTokenizer.from_pretrained(CHECKPOINT)\n"
        "assert len(t) == m.config.vocab_size\n"
        "print(m.config.num_hidden_layers, len(t))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["4", "2048"]


def test_repeats_checkpoint_loads_with_the_same_tokenizer():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(lm.CHECKPOINT / "repeats")
    assert model.config.vocab_size == 2048
    assert lm.manifest(lm.CHECKPOINT / "repeats")["settings"]["repeat_fraction"] == 0.5
    shipped = (lm.CHECKPOINT / "tokenizer.json").read_bytes()
    assert (lm.CHECKPOINT / "repeats" / "tokenizer.json").read_bytes() == shipped


def _logits_and_grads(model, name, ids, mask):
    attention_interface.use(model, name)
    model.zero_grad(set_to_none=True)
    # no loss where the query is padding: it sees no key, and implementations differ there
    labels = ids.masked_fill(mask.roll(1, dims=1) == 0, -100)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    logits = out.logits
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


@pytest.mark.parametrize("reference", ["sdpa", "eager"])
def test_attnlib_attention_equals_reference_forward_and_backward(loaded, batch, reference):
    model, _ = loaded
    ids, mask = batch
    ours, our_grads = _logits_and_grads(model, "attnlib", ids, mask)
    theirs, their_grads = _logits_and_grads(model, reference, ids, mask)
    attention_interface.use(model, "attnlib")
    model.zero_grad(set_to_none=True)
    assert (ours[0] - theirs[0]).abs().max() < 1e-4
    assert (ours[1, 5:] - theirs[1, 5:]).abs().max() < 1e-4  # the padded row's real tokens
    assert our_grads.keys() == their_grads.keys() and len(our_grads) > 10
    for name, grad in our_grads.items():
        scale = their_grads[name].abs().max() + 1e-8
        assert (grad - their_grads[name]).abs().max() / scale < 1e-4, name


def test_interface_mask_conversion_and_errors():
    additive = torch.zeros(1, 1, 2, 3).masked_fill(
        torch.tensor([[0, 1, 1], [0, 0, 1]]).bool(), -1e38
    )
    allowed = attention_interface.allowed_from_mask(additive, 2, 3)
    assert allowed.tolist() == [[[[True, False, False], [True, True, False]]]]
    assert attention_interface.allowed_from_mask(None, 2, 3) is None
    with pytest.raises(ValueError, match="biases"):
        attention_interface.allowed_from_mask(torch.full((1, 1, 2, 3), -0.5), 2, 3)
    with pytest.raises(ValueError, match=r"\[B, 1, T, S\]"):
        attention_interface.allowed_from_mask(torch.zeros(2, 3), 2, 3)


def test_tiny_training_runs_is_deterministic_and_learns(tmp_path):
    assert main(["train-lm", "--tiny", "--out", str(tmp_path / "a"), "--seed", "3"]) == 0
    lm.train(tmp_path / "b", seed=3, settings=lm.TINY, progress=False)
    curves = [(tmp_path / run / "loss_curve.csv").read_text() for run in "ab"]
    assert curves[0] == curves[1]
    losses = [float(line.split(",")[1]) for line in curves[0].splitlines()[1:]]
    assert len(losses) == lm.TINY.steps
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    model, tokenizer = lm.load(tmp_path / "a")
    assert len(tokenizer) == model.config.vocab_size == lm.TINY.vocab_size


def _causal_weights(batch, heads_, tokens, seed):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, heads_, tokens, tokens, generator=generator, dtype=torch.float64)
    hidden = torch.ones(tokens, tokens, dtype=torch.bool).triu(1)
    return scores.masked_fill(hidden, -math.inf).softmax(-1)


def test_head_scores_against_float64_loops():
    weights = _causal_weights(2, 3, 10, seed=1)
    ids = torch.tensor([[1, 2, 1, 3, 2, 1, 4, 5, 4, 1], [7, 7, 8, 9, 8, 7, 6, 6, 9, 1]])
    w = weights.tolist()
    for h in range(3):
        prev = sum(w[b][h][i][i - 1] for b in range(2) for i in range(1, 10)) / 18
        assert math.isclose(float(heads.previous_token_score(weights)[h]), prev, rel_tol=1e-12)
        masses = [
            sum(w[b][h][i][j] for j in range(i) if ids[b][j] == ids[b][i])
            for b in range(2)
            for i in range(10)
            if any(ids[b][j] == ids[b][i] for j in range(i))
        ]
        dup = float(heads.duplicate_token_score(weights, ids)[h])
        assert math.isclose(dup, sum(masses) / len(masses), rel_tol=1e-12)
        sink = sum(w[b][h][i][0] for b in range(2) for i in range(4, 10)) / 12
        assert math.isclose(float(heads.first_token_share(weights, 4)[h]), sink, rel_tol=1e-12)
        half = 5
        ind = sum(w[b][h][half + k][k + 1] for b in range(2) for k in range(half - 1)) / 8
        assert math.isclose(float(heads.induction_score(weights, half)[h]), ind, rel_tol=1e-12)


def test_bracket_pairs_and_scores_against_loops():
    tokens = ["f", "(", "a", "Ġ[", "1", "]", ",", "Ġ(", "b", ")", ")", "Ġ{", "}"]
    pairs = heads.bracket_pairs(tokens)
    assert pairs == [(5, 3), (9, 7), (10, 1), (12, 11)]
    weights = _causal_weights(1, 2, len(tokens), seed=2)
    mass, hits = heads.bracket_scores(weights, [pairs])
    for h in range(2):
        rows = [weights[0, h, q].tolist() for q, _ in pairs]
        expected = sum(row[k] for row, (_, k) in zip(rows, pairs)) / len(pairs)
        assert math.isclose(float(mass[h]), expected, rel_tol=1e-12)
        argmax_hits = sum(
            max(range(len(row)), key=row.__getitem__) == k for row, (_, k) in zip(rows, pairs)
        )
        assert math.isclose(float(hits[h]), argmax_hits / len(pairs), rel_tol=1e-12)
    with pytest.raises(ValueError, match="no closing bracket"):
        heads.bracket_scores(weights, [[]])


def test_cached_generation_equals_generate(loaded, batch):
    model, _ = loaded
    ids = batch[0][:1, :20]
    ours = heads.cached_generate(model, ids, 6)
    theirs = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(ours, theirs)


def test_ablation_hook_zeroes_one_head_and_is_removed(loaded, batch):
    model, _ = loaded
    ids = batch[0][:1, :16]
    before = heads.per_token_loss(model, ids)
    with heads.ablated(model, 0, 1):
        changed = heads.per_token_loss(model, ids)
    assert not torch.equal(before, changed)
    assert torch.equal(before, heads.per_token_loss(model, ids))


def _copy(tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(lm.CHECKPOINT, target)
    return target


def test_missing_file_is_a_clear_error(tmp_path):
    target = _copy(tmp_path)
    (target / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="lacks model.safetensors"):
        lm.load(target)


def test_corrupt_file_is_a_clear_error(tmp_path):
    target = _copy(tmp_path)
    data = (target / "model.safetensors").read_bytes()
    (target / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or unreadable"):
        lm.load(target)


def test_tokenizer_that_does_not_fit_the_config(tmp_path):
    target = _copy(tmp_path)
    tokenizer = lm.train_tokenizer(["def f(x):\n    return x\n"] * 20, 300)
    tokenizer.save_pretrained(target)
    with pytest.raises(ValueError, match="different checkpoints"):
        lm.load(target)


def test_prompt_longer_than_the_context(loaded):
    model, tokenizer = loaded
    with pytest.raises(ValueError, match="trained on 128"):
        lm.encode(tokenizer, lm.heldout_text()[:5000], model.config.max_position_embeddings)
