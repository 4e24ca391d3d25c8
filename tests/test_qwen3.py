"""The Qwen3 lab: the manual pass (eqs. 2.1-6.2, 8.4) against a transformers Qwen3Attention."""

import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention  # noqa: E402

from attnlib.lab import checkpoint, hf_compat, qwen3  # noqa: E402
from attnlib.lab.cli import check_qwen3  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REPORT_FIELDS = {
    "model", "weights", "seq_len", "dtype", "max_abs_diff", "mean_abs_diff", "match", "cases",
    "torch", "transformers", "device", "date", "tolerance",
}  # fmt: skip


@pytest.fixture(scope="module")
def layer():
    return qwen3.random_layer(seed=0)


@pytest.fixture(scope="module")
def cases(layer):
    return qwen3.run_cases(layer, seq_len=12)


@pytest.fixture(scope="module")
def inputs(layer):
    """x [2, 10, 1024] with HF's cos/sin at positions 0..9."""
    x = torch.randn(2, 10, 1024, generator=torch.Generator().manual_seed(1))
    cos, sin = qwen3.hf_cos_sin(layer, x, torch.arange(10).expand(2, 10))
    return x, cos, sin


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer Qwen3 (hidden 64) with random weights, norms included, saved as safetensors.

    Matrices get N(0, 1/fan_in) entries, so the attention outputs are of size ~1 and a wrong
    pass could not hide below the tolerance.
    """
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5)
    path = tmp_path_factory.mktemp("tiny_qwen3")
    model.save_pretrained(path)
    assert list(path.glob("*.safetensors"))
    return model, path


def test_layer_is_qwen3_0_6b_attention_with_random_norms(layer):
    assert isinstance(layer, Qwen3Attention)
    config = layer.config
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (
        1024, 16, 8,
    )  # fmt: skip
    assert layer.head_dim == 128 and config.rms_norm_eps == 1e-6
    assert hf_compat.rope_theta(config) == 1e6
    assert config._attn_implementation == "sdpa"
    assert layer.q_proj.weight.dtype == torch.float32
    for norm in (layer.q_norm, layer.k_norm):
        assert not torch.allclose(norm.weight, torch.ones_like(norm.weight))


@pytest.mark.parametrize("impl", qwen3.IMPLEMENTATIONS)
@pytest.mark.parametrize("case", list(qwen3.CASES))
def test_manual_pass_matches_the_layer(cases, case, impl):
    assert cases[case][impl]["max_abs_diff"] < 1e-4
    assert cases[case][impl]["mean_abs_diff"] < 1e-6


def test_keywords_follow_the_installed_transformers():
    expected = (
        {"cache", "dtype"}
        if transformers.__version__ >= "5"
        else {"past_key_value", "past_key_values", "torch_dtype", "dtype"}
    )
    assert {hf_compat.cache_keyword(), hf_compat.dtype_keyword()} <= expected


def test_manual_pass_steps_match_the_layer_internals(layer, inputs):
    """q_norm must be in the pass: dropping it, or RoPE, moves the output by far more than 1e-4."""
    x, cos, sin = inputs
    mask = qwen3.causal_mask(2, 10, 10, torch.float32)
    reference = qwen3.layer_forward(layer, x, cos, sin, mask)
    with torch.no_grad():
        assert (qwen3.manual_attention(layer, x) - reference).abs().max() < 1e-4
        assert (qwen3.manual_attention(layer, x, rope=False) - reference).abs().max() > 1e-2
        saved = layer.q_norm.weight.clone()
        layer.q_norm.weight.fill_(1.0)
        try:
            assert (qwen3.manual_attention(layer, x) - reference).abs().max() > 1e-2
        finally:
            layer.q_norm.weight.copy_(saved)


def test_causal_mask_is_bottom_right_and_additive():
    mask = qwen3.causal_mask(1, 2, 4, torch.float32)
    assert mask.shape == (1, 1, 2, 4)
    inf = float("-inf")
    assert mask[0, 0].tolist() == [[0.0, 0.0, 0.0, inf], [0.0, 0.0, 0.0, 0.0]]


def test_pitfall_eager_without_mask_is_not_causal(layer, inputs):
    x, cos, sin = inputs
    manual = qwen3.manual_attention(layer, x)
    layer.config._attn_implementation = "eager"
    try:
        unmasked = qwen3.layer_forward(layer, x, cos, sin, mask=None)
        boolean = torch.ones(10, 10, dtype=torch.bool).tril()[None, None]  # True = may attend
        # eager *adds* the mask to the scores: a boolean mask adds 1 and 0 and masks nothing.
        bool_masked = qwen3.layer_forward(layer, x, cos, sin, mask=boolean)
    finally:
        layer.config._attn_implementation = "sdpa"
    assert (unmasked - manual).abs().max() > 0.1
    assert (unmasked[:, -1] - manual[:, -1]).abs().max() < 1e-4  # the last row sees all anyway
    assert (bool_masked - manual).abs().max() > 0.1


def test_pitfall_sdpa_without_mask_drops_cached_keys(layer, inputs):
    x, cos, sin = inputs
    manual = qwen3.manual_attention(layer, x)  # [2, 10, 1024]
    results = {}
    for mask in (None, qwen3.causal_mask(2, 2, 10, torch.float32)):
        cache = transformers.DynamicCache()
        first = qwen3.causal_mask(2, 8, 8, torch.float32)
        qwen3.layer_forward(layer, x[:, :8], cos[:, :8], sin[:, :8], first, cache)
        results[mask is None] = qwen3.layer_forward(
            layer, x[:, 8:], cos[:, 8:], sin[:, 8:], mask, cache
        )
    assert (results[False] - manual[:, 8:]).abs().max() < 1e-4  # explicit bottom-right mask
    assert (results[True] - manual[:, 8:]).abs().max() > 0.1  # no mask: keys 2..9 dropped


def test_bfloat16_matches_within_its_stated_tolerance():
    result = qwen3.report(qwen3.random_layer(seed=0, dtype=torch.bfloat16), seq_len=10)
    assert result["dtype"] == "bfloat16"
    assert result["tolerance"] == qwen3.tolerance("bfloat16", result["output_scale"])
    assert 1e-2 < result["tolerance"] < 1e-1  # outputs of size ~3: 4 steps of 2**-6
    assert result["match"], result["max_abs_diff"]


def test_tolerance_rule():
    assert qwen3.tolerance("float32", 123.0) == 1e-4
    assert qwen3.tolerance("bfloat16", 3.0) == 4 * 2.0**-6  # 3 lies in [2, 4): step 2**(1-7)
    assert qwen3.tolerance("bfloat16", 0.75) == 4 * 2.0**-8


def test_from_pretrained_takes_layer_n_offline(tiny_model, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, path = tiny_model
    loaded = checkpoint.load_layer(str(path), layer=1)
    assert isinstance(loaded, Qwen3Attention) and loaded.layer_idx == 1
    original = model.model.layers[1].self_attn.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    result = qwen3.report(loaded, str(path), str(path), layer_index=1, seq_len=12)
    assert result["output_scale"] > 0.5
    assert result["match"] and result["max_abs_diff"] < 1e-5
    assert result["geometry"]["hidden_size"] == 64
    half = checkpoint.load_layer(
        str(path), layer=0, dtype=torch.bfloat16
    )  # the dtype keyword works
    assert half.q_proj.weight.dtype == torch.bfloat16


def test_load_errors_are_one_line_value_errors(tiny_model, tmp_path):
    _, path = tiny_model
    with pytest.raises(ValueError, match="model folder not found"):
        checkpoint.load_layer(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="out of range"):
        checkpoint.load_layer(str(path), layer=2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        checkpoint.load_layer(str(tmp_path / "empty"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read a model config"):
        checkpoint.load_layer(str(broken))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match="cannot load Qwen3 weights"):
        checkpoint.load_layer(str(no_weights))
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((path / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ValueError, match="not 'qwen3'"):
        checkpoint.load_layer(str(other))


def test_run_default_random_weights(tmp_path, capsys):
    out = tmp_path / "check.json"
    args = Namespace(
        model=None, layer=0, seq_len=12, dtype="float32", device="cpu", seed=0, out=str(out)
    )
    assert check_qwen3(args) == 0
    result = json.loads(out.read_text())
    assert REPORT_FIELDS <= set(result)
    assert result["weights"] == "random" and result["model"] == "Qwen/Qwen3-0.6B"
    assert result["match"] is True and result["max_abs_diff"] < 1e-4
    assert set(result["cases"]) == set(qwen3.CASES)
    assert "match" in capsys.readouterr().out


def test_run_malformed_folder_gives_one_stderr_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text("[]")
    args = Namespace(
        model=str(tmp_path), layer=0, seq_len=12, dtype="float32", device="cpu", seed=0,
        out=str(tmp_path / "x.json"),
    )  # fmt: skip
    assert check_qwen3(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert not (tmp_path / "x.json").exists()


@pytest.fixture(scope="module")
def cli(tiny_model, tmp_path_factory):
    """Run the command twice, at once (a good local model and a missing one), offline."""
    _, path = tiny_model
    folder = tmp_path_factory.mktemp("cli")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "attnlib", "check-qwen3"]
    good = ["--model", str(path), "--layer", "1", "--seq-len", "10"]
    runs = {
        "good": good + ["--out", str(folder / "report" / "attention_check.json")],
        "missing": ["--model", str(folder / "no_such_model"), "--out", str(folder / "x.json")],
    }
    procs = {
        name: subprocess.Popen(
            command + args,
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for name, args in runs.items()
    }
    done = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        done[name] = (proc.returncode, stdout, stderr)
    return done, folder, path


def test_cli_loads_a_local_model_and_writes_the_report(cli):
    done, folder, path = cli
    returncode, stdout, stderr = done["good"]
    assert returncode == 0, stderr
    result = json.loads((folder / "report" / "attention_check.json").read_text())
    assert REPORT_FIELDS <= set(result)
    assert result["weights"] == str(path) and result["seq_len"] == 10 and result["layer"] == 1
    assert result["match"] is True and result["dtype"] == "float32"
    assert result["transformers"] == transformers.__version__
    for case in qwen3.CASES:
        assert set(result["cases"][case]) == {"eager", "sdpa"}
    assert "match" in stdout


def test_cli_missing_model_is_one_line_and_exit_2(cli):
    done, folder, _ = cli
    returncode, _, stderr = done["missing"]
    assert returncode == 2
    assert stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
    assert "Traceback" not in stderr and not (folder / "x.json").exists()
