"""The Qwen3 lab: the book's attention, eqs. 2.1-6.2 and 8.4, against a real Hugging Face layer.

It builds a transformers `Qwen3Attention` with Qwen3-0.6B's attention geometry and seeded random
weights (or takes a layer of a real checkpoint, attnlib.lab.checkpoint), runs the manual pass
with the layer's own weights, and measures the largest difference case by case, on the layer's
`eager` and `sdpa` implementations. `python -m attnlib check-qwen3` prints the result.
"""

import datetime
import logging
import math
import platform

import torch
import transformers
from transformers import DynamicCache, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding

from ..attention import causal_attention
from ..heads import merge_heads
from ..masks import visible
from ..rope import apply_rope, rope_cos_sin
from .hf_compat import cache_keyword, rope_keywords, rope_theta

MODEL = "Qwen/Qwen3-0.6B"
# Qwen3-0.6B's attention: d_model 1024; 16 query heads of 128 (2048 features) share 8 KV heads.
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


def qwen3_config(attn_implementation: str = "sdpa", **geometry) -> Qwen3Config:
    """A one-layer Qwen3Config with Qwen3-0.6B's attention geometry; keys of QWEN3_0_6B override."""
    geometry = {**QWEN3_0_6B, **geometry}
    geometry.update(rope_keywords(geometry.pop("rope_theta")))
    config = Qwen3Config(num_hidden_layers=1, intermediate_size=64, vocab_size=16, **geometry)
    # In transformers 5 a fresh config has _attn_implementation None, and the layer then logs a
    # warning and runs eager. Set it explicitly; the layer reads it again at every forward.
    config._attn_implementation = attn_implementation
    return config


def seed_weights(layer: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Seeded random weights for a real layer, in place: N(0, 1/fan_in) entries for the maps, and
    RMSNorm gains (every `...norm.weight`) from U(0.5, 1.5), since all-ones gains would hide a
    manual pass that forgot to multiply by them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
            else:
                param.copy_(
                    torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[-1])
                )
    return layer


def random_layer(seed: int = 0, dtype=torch.float32, **geometry) -> Qwen3Attention:
    """A real Qwen3Attention with `seed_weights`, Qwen3-0.6B's geometry unless overridden."""
    layer = Qwen3Attention(qwen3_config(**geometry), layer_idx=0)
    return seed_weights(layer, seed).to(dtype).eval()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis, x / sqrt(mean(x^2) + eps) * weight, in float32 as in HF."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _project(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """x W^T (+ b): eq. 2.1 with the layer's own weight [out, in]."""
    y = x @ linear.weight.T
    return y if linear.bias is None else y + linear.bias


def manual_attention(layer: Qwen3Attention, x: torch.Tensor, rope: bool = True) -> torch.Tensor:
    """The book's pass with `layer`'s weights: x [B, T, d_model] at positions 0..T-1 -> same shape.

    Eq. 2.1 projections, per-head RMSNorm, RoPE (eq. 8.4; skipped when rope=False), causal GQA
    attention (eqs. 2.2, 5.1, 7.1, 9.1) and the output projection W_O (eq. 6.2).
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
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # eq. 8.4
    # Causal GQA attention, eqs. 2.2, 5.1, 7.1, 9.1: [B, Hq, T, D]
    y = causal_attention(q, k, v, query_positions=positions, key_positions=positions)
    return _project(merge_heads(y), layer.o_proj)  # [B, T, d_model], eq. 6.2


def causal_mask(batch: int, queries: int, keys: int, dtype, device=None) -> torch.Tensor:
    """The additive mask M of eq. 5.1, bottom-right aligned: [B, 1, T, S], 0 or -inf.

    The T queries are the last T of the S keys (positions S-T..S-1), as after a cache.
    An additive float mask is what both implementations accept: eager adds the mask to the
    scores, so a boolean mask there adds 1 to the allowed scores and 0 to the others, which
    leaves every future key e^-1 of its weight relative to the allowed ones.
    """
    query_positions = torch.arange(keys - queries, keys, device=device).expand(batch, queries)
    key_positions = torch.arange(keys, device=device).expand(batch, keys)
    allowed = visible(query_positions, key_positions)  # [B, 1, T, S], eq. 7.1
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, -math.inf)


def hf_cos_sin(layer: Qwen3Attention, x: torch.Tensor, positions: torch.Tensor):
    """cos, sin [B, T, D] from transformers' own Qwen3RotaryEmbedding at positions [B, T]."""
    rotary = Qwen3RotaryEmbedding(layer.config).to(x.device)
    return rotary(x, positions)


def layer_forward(layer, x, cos, sin, mask, cache=None) -> torch.Tensor:
    """Call the HF layer on x [B, T, d_model] -> [B, T, d_model], passing the cache by its keyword.

    Always pass `mask` (e.g. causal_mask): with attention_mask=None eager is not causal at all,
    and sdpa asks SDPA for its top-left is_causal mask, wrong as soon as there are more keys
    than queries.
    """
    kwargs = {} if cache is None else {cache_keyword(): cache}
    with torch.no_grad():
        return layer(x, position_embeddings=(cos, sin), attention_mask=mask, **kwargs)[0]


def logged_warnings(call):
    """Run call() and return (its result, the warnings transformers logged meanwhile).

    The messages are collected instead of printed: transformers' own stderr handler is off.
    """
    messages, handler = [], logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = transformers.utils.logging.get_logger("transformers")
    transformers.utils.logging.disable_default_handler()
    logger.addHandler(handler)
    try:
        result = call()
    finally:
        logger.removeHandler(handler)
        transformers.utils.logging.enable_default_handler()
    return result, messages


def tolerance(dtype: str, output_scale: float) -> float:
    """The accepted max |diff|; for bfloat16, 4 bfloat16 steps at the largest |output|'s size."""
    if dtype != "bfloat16":
        return TOLERANCE[dtype]
    if math.isnan(output_scale):  # a NaN output: no tolerance, so no match
        return math.nan
    return BFLOAT16_STEPS * 2.0 ** (math.floor(math.log2(max(output_scale, 1e-30))) - 7)


def largest(values) -> float:
    """The largest of `values`, or NaN if any is NaN (Python's max skips a NaN after the first)."""
    values = [float(value) for value in values]
    return math.nan if any(math.isnan(value) for value in values) else max(values)


def _diff(manual: torch.Tensor, layer_out: torch.Tensor) -> dict:
    d = (manual.double() - layer_out.double()).abs()
    scale = layer_out.abs().max().item()  # the largest |output| of the layer
    return {"max_abs_diff": d.max().item(), "mean_abs_diff": d.mean().item(), "output_scale": scale}


def case_rope_off(layer, x, cos, sin, prefill) -> dict:
    """(a) RoPE neutralised (cos=1, sin=0), explicit causal mask"""
    batch, tokens, _ = x.shape
    mask = causal_mask(batch, tokens, tokens, x.dtype, x.device)  # [B, 1, T, T]
    layer_out = layer_forward(layer, x, torch.ones_like(cos), torch.zeros_like(sin), mask)
    return _diff(manual_attention(layer, x, rope=False), layer_out)


def case_rope(layer, x, cos, sin, prefill) -> dict:
    """(b) RoPE at positions 0..T-1"""
    batch, tokens, _ = x.shape
    mask = causal_mask(batch, tokens, tokens, x.dtype, x.device)  # [B, 1, T, T]
    return _diff(manual_attention(layer, x), layer_forward(layer, x, cos, sin, mask))


def _cached(layer, x, cos, sin, prefill: int, new: int) -> dict:
    """Prefill P tokens, then `new` tokens at positions P.., both through one DynamicCache."""
    batch, stop, cache = x.shape[0], prefill + new, DynamicCache()
    pieces = []
    for start, end in ((0, prefill), (prefill, stop)):
        # The new queries see all `end` keys: a bottom-right mask [B, 1, end - start, end].
        # With no mask, sdpa would use SDPA's top-left mask: new query i would see keys 0..i.
        mask = causal_mask(batch, end - start, end, x.dtype, x.device)
        piece = layer_forward(
            layer, x[:, start:end], cos[:, start:end], sin[:, start:end], mask, cache
        )
        pieces.append(piece)
    return _diff(manual_attention(layer, x[:, :stop]), torch.cat(pieces, dim=1))


def case_cached_decode(layer, x, cos, sin, prefill) -> dict:
    """(c) DynamicCache: prefill P tokens, decode 1 at position P"""
    return _cached(layer, x, cos, sin, prefill, new=1)


def case_chunked_prefill(layer, x, cos, sin, prefill) -> dict:
    """(d) DynamicCache: prefill P tokens, then 2 at positions P, P+1"""
    return _cached(layer, x, cos, sin, prefill, new=2)


CASES = {
    "rope_off": case_rope_off,
    "rope": case_rope,
    "cached_decode": case_cached_decode,
    "chunked_prefill": case_chunked_prefill,
}


def run_cases(layer: Qwen3Attention, seq_len: int = 12, batch: int = 2, seed: int = 0) -> dict:
    """Cases (a)-(d) on eager and sdpa: {case: {impl: {max_abs_diff, mean_abs_diff, ...}}}.

    x is seeded [B, seq_len, d_model]; cached cases prefill P = min(8, seq_len - 2) tokens.
    """
    if seq_len < 3:
        raise ValueError(f"seq_len must be at least 3 (prefill plus 2 new tokens), got {seq_len}")
    param = layer.q_proj.weight
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, layer.config.hidden_size, generator=generator)
    x = x.to(dtype=param.dtype, device=param.device)  # [B, T, d_model]
    positions = torch.arange(seq_len, device=param.device).expand(batch, seq_len)  # [B, T]
    cos, sin = hf_cos_sin(layer, x, positions)  # [B, T, D] each
    prefill = min(8, seq_len - 2)
    results, saved = {case: {} for case in CASES}, layer.config._attn_implementation
    try:
        for impl in IMPLEMENTATIONS:
            layer.config._attn_implementation = impl  # read again at every forward
            for name, case in CASES.items():
                with torch.no_grad():
                    results[name][impl] = case(layer, x, cos, sin, prefill)
    finally:
        layer.config._attn_implementation = saved
    return results


def geometry(layer: Qwen3Attention) -> dict:
    """The layer's attention shape: widths, heads, RMSNorm epsilon and RoPE base."""
    config = layer.config
    return {
        "hidden_size": config.hidden_size,
        "q_heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": layer.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": rope_theta(config),
    }


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
    worst = largest(d["max_abs_diff"] for d in diffs)  # NaN if any case gave NaN
    scale = largest(d["output_scale"] for d in diffs)
    bound = tolerance(dtype, scale)
    return {
        "model": model,
        "weights": weights,
        "layer": layer_index,
        "geometry": geometry(layer),
        "seq_len": seq_len,
        "prefill": min(8, seq_len - 2),
        "batch": batch,
        "seed": seed,
        "dtype": dtype,
        "tolerance": bound,
        "output_scale": scale,
        "max_abs_diff": worst,
        "mean_abs_diff": sum(d["mean_abs_diff"] for d in diffs) / len(diffs),
        "match": worst < bound,  # False for a NaN difference or scale
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
        f"Qwen3 attention check: {result['model']}, weights {result['weights']},",
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
