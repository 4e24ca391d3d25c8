"""The DeepSeek lab: attnlib.mla against transformers' DeepseekV3Attention (chapter 23).

As chapter 12 does for Qwen3, it builds the real layer from a small DeepseekV3Config with
seeded random weights (no download), reads its weights into attnlib.mla.MLAWeights and
compares the hand-written pass with the layer case by case: prefill, decode through the
layer's own cache, and a left-padded batch. Also: the bytes per token of real configurations
(eq. 23.3), written as dicts of their config fields.
"""

import inspect
import math

import torch
from transformers import DeepseekV3Config, DynamicCache
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)

from ..attention import causal_attention
from ..masks import left_padding
from ..mla import (
    LatentCache,
    MLAWeights,
    absorbed_attention,
    expand,
    folded_output,
    latents,
    mla_absorbed,
    mla_naive,
    mla_scale,
    naive_attention,
    queries,
)
from .hf_compat import rope_keywords
from .qwen3 import causal_mask, seed_weights

# The small layer of the chapter: 4 heads, d_model 128, d_q 64, d_C 32, d_R 16, Dn = Dv = 32.
SMALL = {
    "hidden_size": 128,
    "num_attention_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
}
# Largest |manual - layer| accepted in float32, as chapter 12's: far above rounding, far below
# a bug.
TOLERANCE = 1e-4

# Real configurations, copied from their config.json files (fields only, no download).
DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
}
QWEN3_0_6B = {  # Qwen/Qwen3-0.6B
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
}


def deepseek_config(attn_implementation: str = "eager", theta: float = 10000.0, **geometry):
    """A one-layer DeepseekV3Config with SMALL's attention geometry; keys override SMALL."""
    geometry = {**SMALL, **geometry}
    config = DeepseekV3Config(
        num_hidden_layers=1,
        intermediate_size=64,
        moe_intermediate_size=32,
        vocab_size=16,
        num_key_value_heads=geometry["num_attention_heads"],
        **rope_keywords(theta),
        **geometry,
    )
    config._attn_implementation = attn_implementation  # read again at every forward
    return config


def random_layer(seed: int = 0, dtype=torch.float32, **options) -> DeepseekV3Attention:
    """A real DeepseekV3Attention with chapter 12's `seed_weights` (its two RMSNorm gains
    included)."""
    layer = DeepseekV3Attention(deepseek_config(**options), layer_idx=0)
    return seed_weights(layer, seed).to(dtype).eval()


def _theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def weights_of(layer: DeepseekV3Attention) -> MLAWeights:
    """The layer's weights as attnlib's row-form maps (nn.Linear stores [out, in])."""
    config = layer.config
    heads, nope, rope = layer.num_heads, config.qk_nope_head_dim, config.qk_rope_head_dim
    d_c, dv = config.kv_lora_rank, config.v_head_dim
    if layer.q_lora_rank is None:
        w_dq, gain_q, w_uq = None, None, layer.q_proj.weight.T
    else:
        w_dq, gain_q = layer.q_a_proj.weight.T, layer.q_a_layernorm.weight
        w_uq = layer.q_b_proj.weight.T
    kv_a = layer.kv_a_proj_with_mqa.weight.T  # [d_model, d_C + d_R]
    kv_b = layer.kv_b_proj.weight.view(heads, nope + dv, d_c)  # [H, Dn + Dv, d_C]
    return MLAWeights(
        w_dq=w_dq,
        gain_q=gain_q,
        w_uq=w_uq.reshape(w_uq.shape[0], heads, nope + rope),
        w_dkv=kv_a[:, :d_c],
        gain_kv=layer.kv_a_layernorm.weight,
        w_kr=kv_a[:, d_c:],
        w_uk=kv_b[:, :nope].transpose(1, 2),
        w_uv=kv_b[:, nope:].transpose(1, 2),
        w_o=layer.o_proj.weight.T.reshape(heads, dv, config.hidden_size),
        eps=layer.kv_a_layernorm.variance_epsilon,
        theta=_theta(config),
        interleaved=bool(config.rope_interleave),
    )


def cache_keyword() -> str:
    """DeepseekV3Attention.forward's cache keyword: `cache` (transformers 5), else
    `past_key_values` (4.x)."""
    params = set(inspect.signature(DeepseekV3Attention.forward).parameters)
    return next(n for n in ("cache", "past_key_values", "past_key_value") if n in params)


def caches_latent() -> bool:
    """Whether this transformers' layer caches the latent (True in 5.x: `cache.update(kv_nope,
    k_rot, ...)`) or the expanded keys and values (4.x: `update(key_states, value_states)`)."""
    source = inspect.getsource(DeepseekV3Attention.forward)
    return "update(kv_nope" in source.replace(" ", "")


def layer_forward(layer, x, positions, mask, cache=None) -> torch.Tensor:
    """The HF layer on x [B, T, d_model] at positions [B, T], with an additive mask."""
    cos, sin = DeepseekV3RotaryEmbedding(layer.config)(x, positions)
    kwargs = {} if cache is None else {cache_keyword(): cache}
    with torch.no_grad():
        return layer(x, position_embeddings=(cos, sin), attention_mask=mask, **kwargs)[0]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def run_cases(layer, tokens: int = 10, batch: int = 2, seed: int = 0, prefill: int = 7) -> dict:
    """{case: max |manual - layer|} for prefill, cached decode and a left-padded batch, each
    for the naive and the absorbed pass; x is seeded [B, tokens, d_model]."""
    w = weights_of(layer)
    dtype = layer.o_proj.weight.dtype
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, tokens, layer.config.hidden_size, generator=gen).to(dtype)
    pos = torch.arange(tokens).expand(batch, tokens)
    out = {}
    with torch.no_grad():
        ref = layer_forward(layer, x, pos, causal_mask(batch, tokens, tokens, dtype))
        for name, path in (("naive", mla_naive), ("absorbed", mla_absorbed)):
            out[f"prefill, {name}"] = _max_diff(path(x, w), ref)
        # Decode: prefill P tokens, then one at a time, through the layer's own cache.
        hf_cache, pieces = DynamicCache(), []
        for start, end in [(0, prefill)] + [(t, t + 1) for t in range(prefill, tokens)]:
            mask = causal_mask(batch, end - start, end, dtype)
            pieces.append(layer_forward(layer, x[:, start:end], pos[:, start:end], mask, hf_cache))
        hf = torch.cat(pieces, dim=1)
        for name, path in (("naive", mla_naive), ("absorbed", mla_absorbed)):
            cache, mine = LatentCache(w.latent_dim), []
            for start, end in [(0, prefill)] + [(t, t + 1) for t in range(prefill, tokens)]:
                mine.append(path(x[:, start:end], w, cache, torch.arange(start, end)))
            out[f"decode, {name}"] = _max_diff(torch.cat(mine, dim=1), hf)
        out.update(_padded(layer, w, x))
    return out


def _padded(layer, w, x) -> dict:
    """A left-padded batch: row b has its first tokens - lengths[b] slots as padding."""
    batch, tokens, _ = x.shape
    lengths = [tokens - 3 * (b % 2) for b in range(batch)]
    positions, allowed = left_padding(lengths, tokens)  # [B, T], [B, 1, 1, T]
    mask = causal_mask(batch, tokens, tokens, x.dtype).masked_fill(~allowed, -math.inf)
    # Pad queries see no key: HF's softmax gives NaN there, attnlib zeros. Compare real rows.
    ref = layer_forward(layer, x, positions.clamp(min=0), mask)
    real = allowed[:, 0, 0, :, None]  # [B, T, 1]
    out = {}
    for name, path in (("naive", mla_naive), ("absorbed", mla_absorbed)):
        mine = path(x, w, positions=positions, allowed=allowed)
        out[f"padding, {name}"] = _max_diff(mine * real, torch.nan_to_num(ref) * real)
    return out


def cache_bytes_per_token(config: dict, dtype_bytes: int = 2) -> dict:
    """Eq. 23.3 per token and layer, in bytes, from a config's fields (MLA or GQA/MHA)."""
    if "kv_lora_rank" in config:
        numbers = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    else:
        numbers = 2 * config["num_key_value_heads"] * config["head_dim"]
    return {"numbers": numbers, "bytes": numbers * dtype_bytes}


# ------------------------------------------------------------ one decode step, three ways

# The timed layer: DeepSeek-V3's shape, with 8 of its 128 heads and half its latent.
TIMED = {"heads": 8, "d_c": 256, "d_r": 32, "nope": 64, "dv": 64, "d_model": 1024}


def timed_weights(seed: int = 0, heads=8, d_c=256, d_r=32, nope=64, dv=64, d_model=1024):
    """Seeded float32 MLA maps of the timed shape (no query compression)."""
    g = torch.Generator().manual_seed(seed)

    def n(*shape):
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-2])

    return MLAWeights(
        w_dq=None,
        gain_q=None,
        w_uq=n(d_model, heads * (nope + d_r)).view(d_model, heads, nope + d_r),
        w_dkv=n(d_model, d_c),
        gain_kv=torch.ones(d_c),
        w_kr=n(d_model, d_r),
        w_uk=n(heads, d_c, nope),
        w_uv=n(heads, d_c, dv),
        w_o=n(heads, dv, d_model),
    )


def decode_calls(w: MLAWeights, cache_len: int, seed: int = 0) -> dict:
    """Three callables for one decode step (B = 1) whose token is the last of `cache_len`
    cached ones: re-expanding the latent cache, reading a cache of expanded keys and values,
    and the absorbed step over the latents. Each returns the output [1, 1, d_model]; the
    caches are built beforehand, so each call reads its cache once and writes nothing to it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, cache_len, w.w_dkv.shape[0], generator=g)
    positions = torch.arange(cache_len)
    with torch.no_grad():
        c, k_r = latents(x, w, positions)
        rows = torch.cat((c, k_r), dim=-1)  # the latent cache [1, S, d_C + d_R]
        keys, values = expand(c, k_r, w)  # the expanded cache [1, H, S, *]
        q_c, q_r = queries(x[:, -1:], w, positions[-1:])  # the step's queries
    w_ov = folded_output(w)
    scale = mla_scale(w)

    def expanded():
        q = torch.cat((q_c, q_r), dim=-1)  # [1, H, 1, Dn + d_R]
        o = causal_attention(q, keys, values, scale=scale)  # [1, H, 1, Dv]
        return torch.einsum("bhtd,hdm->btm", o, w.w_o)

    return {
        "naive re-expansion": lambda: naive_attention(q_c, q_r, rows, w),
        "expanded cache": expanded,
        "absorbed": lambda: absorbed_attention(q_c, q_r, rows, w, w_ov=w_ov),
    }


def step_counts(cache_len: int, heads, d_c, d_r, nope, dv, nbytes: int = 4) -> dict:
    """Eq. 23.9: {path: (FLOPs, bytes read)} of one decode step's attention over S cached tokens,
    one query per head, B = 1; multiply-adds counted as 2 FLOPs, cache bytes only."""
    s = cache_len
    attend = 2 * s * heads * (nope + d_r + dv)  # scores and weighted sum, eq. 2.2
    return {
        "naive re-expansion": (
            2 * s * d_c * heads * (nope + dv) + attend,
            s * (d_c + d_r) * nbytes,
        ),
        "expanded cache": (attend, s * heads * (nope + d_r + dv) * nbytes),
        "absorbed": (2 * s * heads * (2 * d_c + d_r), s * (d_c + d_r) * nbytes),
    }
