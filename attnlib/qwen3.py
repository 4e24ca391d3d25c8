"""The Qwen3 lab: the book's attention, eqs. 3.1-3.12 and 3.17, against a real Hugging Face layer.

`python -m attnlib check-qwen3` builds a transformers `Qwen3Attention` with Qwen3-0.6B's attention
geometry and seeded random weights (or takes layer N of a real checkpoint), runs the manual pass
with the layer's own weights, and reports the largest difference, case by case, on the layer's
`eager` and `sdpa` implementations. This is the only attnlib module that imports transformers.
It runs on transformers 5.x and on 4.x from 4.51 (Colab); differences are picked by signature.
"""

import datetime
import inspect
import json
import math
import os
import platform
import sys
from pathlib import Path

import torch
import transformers
from huggingface_hub.utils import logging as hub_logging
from transformers import AutoConfig, DynamicCache, PretrainedConfig, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3Model,
    Qwen3RotaryEmbedding,
)

from .attention import causal_attention, merge_heads, visible
from .rope import apply_rope, rope_cos_sin

MODEL = "Qwen/Qwen3-0.6B"
# Qwen3-0.6B's attention: d_model 1024 = 16 query heads x 128, sharing 8 KV heads (GQA).
QWEN3_0_6B = {
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
}
# Largest |manual - layer| accepted. float32: 1e-4, far above the ~1e-6 seen, far below a bug.
# float64: 1e-6, because HF's eager path computes its softmax in float32 even for float64 input.
# bfloat16 keeps 8 significant bits, so outputs of size in [2**e, 2**(e+1)) are spaced 2**(e-7)
# apart; the two passes round at different places, and we accept 4 such steps (see tolerance()).
TOLERANCE = {"float32": 1e-4, "float64": 1e-6}
BFLOAT16_STEPS = 4
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
IMPLEMENTATIONS = ("eager", "sdpa")
CASES = {
    "rope_off": "(a) RoPE neutralised (cos=1, sin=0), explicit causal mask",
    "rope": "(b) RoPE at positions 0..T-1",
    "cached_decode": "(c) DynamicCache: prefill P tokens, decode 1 at position P",
    "chunked_prefill": "(d) DynamicCache: prefill P tokens, then 2 at positions P, P+1",
}


def _parameters(function) -> set:
    return set(inspect.signature(function).parameters)


def dtype_keyword() -> str:
    """from_pretrained's dtype keyword: `dtype` (transformers 5 and 4.56+), else `torch_dtype`."""
    return "dtype" if "dtype" in _parameters(PretrainedConfig.__init__) else "torch_dtype"


def cache_keyword() -> str:
    """Qwen3Attention.forward's cache keyword: `cache` (v5), `past_key_values`, `past_key_value`."""
    params = _parameters(Qwen3Attention.forward)
    return next(name for name in ("cache", "past_key_values", "past_key_value") if name in params)


def qwen3_config(attn_implementation: str = "sdpa", **geometry) -> Qwen3Config:
    """A one-layer Qwen3Config with Qwen3-0.6B's attention geometry; keys of QWEN3_0_6B override."""
    geometry = {**QWEN3_0_6B, **geometry}
    theta = geometry.pop("rope_theta")
    if "rope_parameters" in _parameters(Qwen3Config.__init__):  # transformers 5
        geometry["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    else:  # transformers 4.x
        geometry["rope_theta"] = theta
    config = Qwen3Config(num_hidden_layers=1, intermediate_size=64, vocab_size=16, **geometry)
    # A fresh config has _attn_implementation None, and the layer then falls back to eager with a
    # warning. Set it explicitly; the layer reads it again at every forward.
    config._attn_implementation = attn_implementation
    return config


def random_layer(seed: int = 0, dtype=torch.float32, **geometry) -> Qwen3Attention:
    """A real Qwen3Attention with seeded random weights, Qwen3-0.6B's geometry unless overridden.

    Projections get N(0, 1/fan_in) entries. The q_norm/k_norm gains are drawn from U(0.5, 1.5):
    all-ones gains would hide a manual pass that forgot to multiply by them.
    """
    layer = Qwen3Attention(qwen3_config(**geometry), layer_idx=0)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
            else:
                param.copy_(
                    torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[-1])
                )
    return layer.to(dtype).eval()


def load_layer(model: str, layer: int = 0, dtype=torch.float32) -> Qwen3Attention:
    """Layer `layer`'s Qwen3Attention from a Hub id or a local folder (safetensors only).

    Raises ValueError with one line naming the problem when the folder is missing or malformed.
    Remote code is never run: only transformers' own Qwen3 classes are used.
    """
    looks_local = os.path.exists(model) or model.startswith((".", "/", "~", os.sep))
    if looks_local:
        model = os.path.expanduser(model)
        if not os.path.isdir(model):
            raise ValueError(f"model folder not found: {model}")
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"no config.json in the model folder {model}")
    try:
        config = AutoConfig.from_pretrained(model)
    except Exception as err:  # OSError, ValueError, JSON errors: all mean "not a usable config"
        raise ValueError(f"cannot read a model config from {model}: {_first_line(err)}") from None
    if config.model_type != "qwen3":
        raise ValueError(f"{model} is a {config.model_type!r} model, not 'qwen3'")
    if not 0 <= layer < config.num_hidden_layers:
        raise ValueError(
            f"layer {layer} out of range: {model} has {config.num_hidden_layers} layers"
        )
    kwargs = {dtype_keyword(): dtype, "use_safetensors": True, "attn_implementation": "sdpa"}
    try:
        base = Qwen3Model.from_pretrained(model, **kwargs)
    except Exception as err:  # missing or broken safetensors, shape mismatches
        raise ValueError(f"cannot load Qwen3 weights from {model}: {_first_line(err)}") from None
    return base.layers[layer].self_attn.eval()


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def rope_theta(config) -> float:
    """The RoPE base of a Qwen3 config (v5 `rope_parameters`, v4 `rope_theta`); plain RoPE only."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"the manual pass implements plain RoPE only, this model uses {kind!r}")
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis, x / sqrt(mean(x^2) + eps) * weight, in float32 as in HF."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _project(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """x W^T (+ b): eq. 3.1 with the layer's own weight [out, in]."""
    y = x @ linear.weight.T
    return y if linear.bias is None else y + linear.bias


def manual_attention(layer: Qwen3Attention, x: torch.Tensor, rope: bool = True) -> torch.Tensor:
    """The book's pass with `layer`'s weights: x [B, T, d_model] at positions 0..T-1 -> same shape.

    Eq. 3.1 projections, per-head RMSNorm, RoPE (eq. 3.17; skipped when rope=False), causal GQA
    attention (eqs. 3.2, 3.10, 3.13, 3.14) and the output projection W_O (eq. 3.12).
    """
    config = layer.config
    batch, tokens, _ = x.shape
    q_heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = layer.head_dim
    q = _project(x, layer.q_proj).view(batch, tokens, q_heads, head_dim)  # [B, T, Hq, D]
    k = _project(x, layer.k_proj).view(batch, tokens, kv_heads, head_dim)  # [B, T, Hkv, D]
    v = _project(x, layer.v_proj).view(batch, tokens, kv_heads, head_dim)  # [B, T, Hkv, D]
    # Qwen3 normalises each head's D features (q_norm, k_norm) before the transpose to heads-first.
    q = rms_norm(q, layer.q_norm.weight, config.rms_norm_eps).transpose(1, 2)  # [B, Hq, T, D]
    k = rms_norm(k, layer.k_norm.weight, config.rms_norm_eps).transpose(1, 2)  # [B, Hkv, T, D]
    v = v.transpose(1, 2)  # [B, Hkv, T, D]
    positions = torch.arange(tokens, device=x.device)  # [T]
    if rope:
        cos, sin = rope_cos_sin(positions, head_dim, rope_theta(config))  # [T, D] each
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # eq. 3.17
    # Causal GQA attention, eqs. 3.2, 3.10, 3.13, 3.14: [B, Hq, T, D]
    y = causal_attention(q, k, v, query_positions=positions, key_positions=positions)
    return _project(merge_heads(y), layer.o_proj)  # [B, T, d_model], eq. 3.12


def causal_mask(batch: int, queries: int, keys: int, dtype, device=None) -> torch.Tensor:
    """The additive mask M of eq. 3.10, bottom-right aligned: [B, 1, T, S], 0 or -inf.

    The T queries are the last T of the S keys (positions S-T..S-1), as after a cache.
    An additive float mask is what both implementations accept: eager adds the mask to the
    scores, so a boolean mask there would add 1 and 0 and mask nothing.
    """
    query_positions = torch.arange(keys - queries, keys, device=device).expand(batch, queries)
    key_positions = torch.arange(keys, device=device).expand(batch, keys)
    allowed = visible(query_positions, key_positions)  # [B, 1, T, S], eq. 3.13
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, -math.inf)


def hf_cos_sin(layer: Qwen3Attention, x: torch.Tensor, positions: torch.Tensor):
    """cos, sin [B, T, D] from transformers' own Qwen3RotaryEmbedding at positions [B, T]."""
    rotary = Qwen3RotaryEmbedding(layer.config).to(x.device)
    return rotary(x, positions)


def layer_forward(layer, x, cos, sin, mask, cache=None) -> torch.Tensor:
    """Call the HF layer on x [B, T, d_model] -> [B, T, d_model], passing the cache by its keyword.

    Always pass `mask` (e.g. causal_mask): with attention_mask=None eager is not causal at all,
    and sdpa with more keys than queries silently drops the keys past the first T.
    """
    kwargs = {} if cache is None else {cache_keyword(): cache}
    with torch.no_grad():
        return layer(x, position_embeddings=(cos, sin), attention_mask=mask, **kwargs)[0]


def tolerance(dtype: str, output_scale: float) -> float:
    """The accepted max |diff|; for bfloat16, 4 bfloat16 steps at the largest |output|'s size."""
    if dtype != "bfloat16":
        return TOLERANCE[dtype]
    return BFLOAT16_STEPS * 2.0 ** (math.floor(math.log2(max(output_scale, 1e-30))) - 7)


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a.double() - b.double()).abs()
    scale = b.abs().max().item()  # the largest |output| of the layer
    return {"max_abs_diff": d.max().item(), "mean_abs_diff": d.mean().item(), "output_scale": scale}


def run_cases(layer: Qwen3Attention, seq_len: int = 12, batch: int = 2, seed: int = 0) -> dict:
    """Cases (a)-(d) on eager and sdpa: {case: {impl: {max_abs_diff, mean_abs_diff}}}.

    Cached cases prefill P = min(8, seq_len - 2) tokens through the layer's own DynamicCache.
    """
    if seq_len < 3:
        raise ValueError(f"seq_len must be at least 3 (prefill plus 2 new tokens), got {seq_len}")
    param = layer.q_proj.weight
    dtype, device = param.dtype, param.device
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, layer.config.hidden_size, generator=generator)
    x = x.to(dtype=dtype, device=device)  # [B, T, d_model]
    prefill = min(8, seq_len - 2)
    positions = torch.arange(seq_len, device=device).expand(batch, seq_len)  # [B, T]
    cos, sin = hf_cos_sin(layer, x, positions)  # [B, T, D] each
    with torch.no_grad():
        manual_off = manual_attention(layer, x, rope=False)
        manual = manual_attention(layer, x)
        manual_decode = manual_attention(layer, x[:, : prefill + 1])
        manual_chunk = manual_attention(layer, x[:, : prefill + 2])

    def cached(new: int) -> torch.Tensor:
        """Prefill, then `new` tokens at positions prefill.., both through one DynamicCache."""
        cache, stop = DynamicCache(), prefill + new
        first = layer_forward(
            layer, x[:, :prefill], cos[:, :prefill], sin[:, :prefill],
            causal_mask(batch, prefill, prefill, dtype, device), cache,
        )  # fmt: skip
        # The new queries see all `stop` keys: bottom-right mask [B, 1, new, stop]. With no mask,
        # sdpa would keep only the first `new` keys of the cache.
        rest = layer_forward(
            layer, x[:, prefill:stop], cos[:, prefill:stop], sin[:, prefill:stop],
            causal_mask(batch, new, stop, dtype, device), cache,
        )  # fmt: skip
        return torch.cat([first, rest], dim=1)  # [B, stop, d_model]

    results, saved = {case: {} for case in CASES}, layer.config._attn_implementation
    try:
        for impl in IMPLEMENTATIONS:
            layer.config._attn_implementation = impl
            # Always an explicit mask: with attention_mask=None, eager is not causal at all.
            mask = causal_mask(batch, seq_len, seq_len, dtype, device)  # [B, 1, T, T]
            no_rope = layer_forward(layer, x, torch.ones_like(cos), torch.zeros_like(sin), mask)
            results["rope_off"][impl] = _diff(manual_off, no_rope)
            results["rope"][impl] = _diff(manual, layer_forward(layer, x, cos, sin, mask))
            results["cached_decode"][impl] = _diff(manual_decode, cached(1))
            results["chunked_prefill"][impl] = _diff(manual_chunk, cached(2))
    finally:
        layer.config._attn_implementation = saved
    return results


def device_name(device: torch.device) -> str:
    """A short description of the machine the check ran on."""
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def report(
    layer: Qwen3Attention,
    model: str = MODEL,
    weights: str = "random",
    layer_index: int = 0,
    seq_len: int = 12,
    batch: int = 2,
    seed: int = 0,
) -> dict:
    """Run all cases and return the JSON-ready report (differences, versions, device, date)."""
    dtype = str(layer.q_proj.weight.dtype).replace("torch.", "")
    cases = run_cases(layer, seq_len, batch, seed)
    diffs = [d for per_impl in cases.values() for d in per_impl.values()]
    worst = max(d["max_abs_diff"] for d in diffs)
    bound = tolerance(dtype, max(d["output_scale"] for d in diffs))
    config = layer.config
    return {
        "model": model,
        "weights": weights,
        "layer": layer_index,
        "geometry": {
            "hidden_size": config.hidden_size,
            "q_heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads,
            "head_dim": layer.head_dim,
            "rms_norm_eps": config.rms_norm_eps,
            "rope_theta": rope_theta(config),
        },
        "seq_len": seq_len,
        "prefill": min(8, seq_len - 2),
        "batch": batch,
        "seed": seed,
        "dtype": dtype,
        "tolerance": bound,
        "output_scale": max(d["output_scale"] for d in diffs),
        "max_abs_diff": worst,
        "mean_abs_diff": sum(d["mean_abs_diff"] for d in diffs) / len(diffs),
        "match": worst < bound,
        "cases": cases,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": device_name(layer.q_proj.weight.device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def format_report(result: dict) -> str:
    """The report as a small table: one row per case, max |manual - layer| for eager and sdpa."""
    lines = [
        f"Qwen3 attention check: {result['model']}, weights {result['weights']}, "
        f"layer {result['layer']}, {result['dtype']}, T={result['seq_len']}, B={result['batch']}",
        f"{'case':<18}" + "".join(f"{impl:>10}" for impl in IMPLEMENTATIONS),
    ]
    for case, per_impl in result["cases"].items():
        row = "".join(f"{per_impl[impl]['max_abs_diff']:>10.1e}" for impl in IMPLEMENTATIONS)
        lines.append(f"{case:<18}{row}")
    verdict = "match" if result["match"] else "NO MATCH"
    lines.append(
        f"max |diff| {result['max_abs_diff']:.1e} (tolerance {result['tolerance']:.1e}): {verdict}"
    )
    lines.append(
        f"torch {result['torch']}, transformers {result['transformers']}, {result['device']}"
    )
    return "\n".join(lines)


def add_arguments(parser) -> None:
    """The options of `python -m attnlib check-qwen3`."""
    parser.add_argument(
        "--model",
        default=None,
        help="Hub id or local folder of a Qwen3 checkpoint (safetensors); default: random weights "
        f"with {MODEL}'s attention geometry, nothing downloaded",
    )
    parser.add_argument("--layer", type=int, default=0, help="which layer's attention (default 0)")
    parser.add_argument("--seq-len", type=int, default=12, help="tokens per sequence (default 12)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="auto", help="cpu, cuda, ... (default: cuda if any)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="artifacts/attention_check.json", help="JSON report path")


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA GPU")
    return device


def run(args) -> int:
    """Build or load the layer, check it, print and save the report.

    Returns 0 on a match, 1 on a mismatch, 2 (with one "error: ..." line on stderr) on bad input.
    """
    verbosity = transformers.logging.get_verbosity(), hub_logging.get_verbosity()
    try:
        if args.seq_len < 3:
            raise ValueError(f"--seq-len must be at least 3, got {args.seq_len}")
        device, dtype = _device(args.device), DTYPES[args.dtype]
        if args.model is None:
            layer, index = random_layer(args.seed, dtype), 0
        else:
            # On failure stderr gets our one line, not the libraries' warnings and retries.
            transformers.logging.set_verbosity_error()
            hub_logging.set_verbosity_error()
            layer, index = load_layer(args.model, args.layer, dtype), args.layer
        weights = "random" if args.model is None else args.model
        result = report(
            layer.to(device), args.model or MODEL, weights, index, args.seq_len, seed=args.seed
        )
    except (ValueError, RuntimeError) as err:
        print(f"error: {_first_line(err)}", file=sys.stderr)
        return 2
    finally:
        transformers.logging.set_verbosity(verbosity[0])
        hub_logging.set_verbosity(verbosity[1])
    print(format_report(result))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if result["match"] else 1
