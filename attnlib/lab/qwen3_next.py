"""Qwen3-Next's Gated DeltaNet layer in transformers, and the same layer written by hand.

`small_config` builds a small random `Qwen3NextConfig` (nothing downloaded);
`hf_gated_deltanet` its `Qwen3NextGatedDeltaNet`, on the torch path (the optional
flash-linear-attention and causal-conv1d kernels are not used); `gated_deltanet_by_hand`
recomputes the layer's forward from its weights with `attnlib.delta_rule` (eq. 25.11).
`hybrid_layout` and `decode_step_bytes` read the layer plan of a config and count the bytes
a decode step reads from its caches (eqs. 10.1 and 25.5). Works on transformers 4.57.1 to 5.x.
"""

import contextlib

import torch
import torch.nn.functional as F

from ..delta_rule import gated_delta_rule_chunked
from .decode import kv_cache_bytes


@contextlib.contextmanager
def quiet_transformers():
    """Silence transformers' notice that the optional kernels fall back to torch."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def small_config(**overrides):
    """A small Qwen3NextConfig: width 64, 2 key heads and 4 value heads of 16 features,
    a short convolution of 4 taps, 4 layers (3 Gated DeltaNet, then 1 attention)."""
    from transformers import Qwen3NextConfig

    kwargs = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )
    kwargs.update(overrides)
    return Qwen3NextConfig(**kwargs)


def hf_gated_deltanet(config, seed: int = 0, dtype=torch.float64):
    """transformers' Qwen3NextGatedDeltaNet (layer 0) with seeded random weights; the decay
    parameters drawn as in the model's initialisation (A in [1, 16], dt_bias around 0)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    with quiet_transformers(), torch.random.fork_rng():
        torch.manual_seed(seed)
        layer = Qwen3NextGatedDeltaNet(config, layer_idx=0)
        with torch.no_grad():
            layer.A_log.copy_(torch.empty_like(layer.A_log).uniform_(1, 16).log())
            layer.dt_bias.normal_(0, 0.5)
            layer.norm.weight.uniform_(0.5, 1.5)
    return layer.to(dtype).eval()


def run_hf(layer, x):
    """The transformers layer's forward, with no cache, its fallback notices silenced."""
    with quiet_transformers(), torch.no_grad():
        return layer(x)


def gated_deltanet_by_hand(layer, x, chunk: int = 64):
    """Eq. (25.11): the layer's forward from its weights, x [B, T, d_model] in float64.

    Projections, the short causal convolution with SiLU, eta = sigmoid(b) (transformers'
    beta), alpha = exp(-e^{A_log} softplus(a + dt_bias)), unit-norm queries and keys with
    the queries scaled by 1/sqrt(D), the gated delta rule (eq. 25.10), then an RMSNorm of
    each head's output gated by SiLU(z), and the output projection.
    """
    x = x.double()
    hk, hv = layer.num_k_heads, layer.num_v_heads
    dk, dv, per = layer.head_k_dim, layer.head_v_dim, layer.num_v_heads // layer.num_k_heads
    b, t, _ = x.shape
    w = {n: p.detach().double() for n, p in layer.named_parameters()}
    # 1. Projections, grouped by key head: [q | k | v of its value heads | z of them].
    qkvz = (x @ w["in_proj_qkvz.weight"].T).view(b, t, hk, 2 * dk + 2 * per * dv)
    q, k, v, z = qkvz.split([dk, dk, per * dv, per * dv], dim=-1)
    ba = (x @ w["in_proj_ba.weight"].T).view(b, t, hk, 2 * per)
    beta, a = (u.reshape(b, t, hv) for u in ba.split([per, per], dim=-1))
    # 2. The short convolution: each channel mixes itself over the last K tokens.
    mixed = torch.cat([u.reshape(b, t, -1) for u in (q, k, v)], dim=-1)  # [B, T, channels]
    kernel = w["conv1d.weight"][:, 0]  # [channels, K]
    taps = kernel.shape[-1]
    padded = F.pad(mixed, (0, 0, taps - 1, 0))  # K - 1 zeros before the first token
    conv = sum(padded[:, m : m + t] * kernel[:, m] for m in range(taps))
    q, k, v = F.silu(conv).split([hk * dk, hk * dk, hv * dv], dim=-1)
    # 3. Heads [B, H, T, D]; each key head serves `per` value heads.
    q, k = (u.view(b, t, hk, dk).repeat_interleave(per, dim=2).transpose(1, 2) for u in (q, k))
    v = v.reshape(b, t, hv, dv).transpose(1, 2)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) / dk**0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    eta = torch.sigmoid(beta).transpose(1, 2)  # [B, Hv, T]
    alpha = torch.exp(-w["A_log"].exp() * F.softplus(a + w["dt_bias"])).transpose(1, 2)
    out, _ = gated_delta_rule_chunked(q, k, v, alpha, eta, chunk=chunk)  # [B, Hv, T, Dv]
    # 4. Gated RMSNorm per head, then the output projection.
    out = out.transpose(1, 2)  # [B, T, Hv, Dv]
    eps = layer.norm.variance_epsilon
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps) * w["norm.weight"]
    out = out * F.silu(z.reshape(b, t, hv, dv))
    return out.reshape(b, t, hv * dv) @ w["out_proj.weight"].T


def hybrid_layout(config) -> dict:
    """The layer plan of a Qwen3-Next config: counts of each layer type."""
    kinds = list(config.layer_types)
    return {kind: kinds.count(kind) for kind in dict.fromkeys(kinds)}


def decode_step_bytes(config, tokens: int, bytes_per_number: int = 2) -> dict:
    """Bytes of cache one decode step reads at `tokens` tokens of context: the KV cache of
    each attention layer (eq. 10.1), the state of each Gated DeltaNet layer (eq. 25.5:
    Hv Dk Dv numbers, plus the convolution's last K - 1 inputs), and the same for a model
    whose every layer is attention. Weights are left out."""
    plan = hybrid_layout(config)
    dtype = {2: torch.bfloat16, 4: torch.float32}[bytes_per_number]
    per_attention = kv_cache_bytes(
        tokens, 1, config.num_key_value_heads, config.head_dim, dtype=dtype
    )
    conv_channels = 2 * config.linear_num_key_heads * config.linear_key_head_dim + (
        config.linear_num_value_heads * config.linear_value_head_dim
    )
    per_linear = bytes_per_number * (
        config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
        + (config.linear_conv_kernel_dim - 1) * conv_channels
    )
    hybrid = plan.get("full_attention", 0) * per_attention
    hybrid += plan.get("linear_attention", 0) * per_linear
    return {
        "per_attention_layer": per_attention,
        "per_linear_layer": per_linear,
        "hybrid": hybrid,
        "all_attention": config.num_hidden_layers * per_attention,
    }


def hf_gated_delta_rule(kind: str, q, k, v, alpha, eta, chunk: int = 64):
    """transformers' `torch_recurrent_gated_delta_rule` (kind "recurrent") or
    `torch_chunk_gated_delta_rule` ("chunk") in the book's layout: q, k [B, H, T, D],
    v [B, H, T, Dv], alpha and eta [B, H, T]; returns (O [B, H, T, Dv], final state) in
    float64. transformers takes [B, T, H, D], the log-decay g = log alpha, eta as `beta`,
    computes in float32 and normalises q and k (use_qk_l2norm_in_kernel)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    args = [x.transpose(1, 2).float() for x in (q, k, v, alpha.log(), eta)]
    fn = hf.torch_recurrent_gated_delta_rule if kind == "recurrent" else None
    extra = {}
    if kind == "chunk":
        fn, extra = hf.torch_chunk_gated_delta_rule, {"chunk_size": chunk}
    if fn is None:
        raise ValueError(f"kind must be 'recurrent' or 'chunk', got {kind!r}")
    with quiet_transformers():
        out, state = fn(
            *args[:3],
            g=args[3],
            beta=args[4],
            initial_state=None,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            **extra,
        )
    return out.transpose(1, 2).double(), state.double()
