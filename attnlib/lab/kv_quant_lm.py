"""KV-cache quantisation measured on the book's checkpoint (chapter 19's model), chapter 23.

Each scheme quantises the keys and/or values of every layer (attnlib.kv_quant, eq. 23.10),
through forward hooks on the layers' `k_norm` (the keys after their norm, before RoPE) and
`v_proj` (the values), and reports the held-out loss increase over the unquantised model.
Keys quantised "after RoPE" are turned to their positions, quantised, and turned back inside
the same hook, which is exact up to float rounding and leaves the layer's own RoPE in place.
Every group is quantised, the newest tokens included (KIVI keeps a recent window in full
precision until a group of tokens fills): the pessimistic side.
"""

import json
from contextlib import contextmanager

import torch

from ..kv_quant import fp8_roundtrip, quantize
from ..rope import apply_rope, rope_cos_sin
from . import lm, lm_heads

GROUP = 32  # numbers per group: one head's features per token, or 32 tokens of one feature
BITS = (8, 4, 3, 2)
# name: (what, axis, where): axis "token" groups a token's features, "channel" a feature's tokens
SCHEMES = {
    "keys per token": ("key", "token", "after"),
    "keys per channel": ("key", "channel", "after"),
    "keys per token, before RoPE": ("key", "token", "before"),
    "keys per channel, before RoPE": ("key", "channel", "before"),
    "values per token": ("value", "token", None),
    "KIVI: keys per channel, values per token": ("both", "channel", "after"),
}


def _quantize_rows(x: torch.Tensor, bits, axis: str) -> torch.Tensor:
    """x [B, T, Hkv, D]: per token, groups along D; per channel, groups of GROUP along T."""
    if bits == "fp8":
        return fp8_roundtrip(x)
    return quantize(x, bits, GROUP, axis=-1 if axis == "token" else 1)


def _key_hook(bits, axis, where, theta):
    def hook(module, inputs, k):  # k [B, T, Hkv, D], after k_norm, before RoPE
        if where == "before":
            return _quantize_rows(k, bits, axis)
        cos, sin = rope_cos_sin(torch.arange(k.shape[1]), k.shape[-1], theta)  # [T, D]
        turned = apply_rope(k.transpose(1, 2), cos, sin).transpose(1, 2)  # eq. 8.4
        q = _quantize_rows(turned, bits, axis)
        return apply_rope(q.transpose(1, 2), cos, -sin).transpose(1, 2)  # turned back

    return hook


def _value_hook(bits, axis, heads, head_dim):
    def hook(module, inputs, v):  # v [B, T, Hkv * D]
        shaped = v.view(*v.shape[:2], heads, head_dim)
        return _quantize_rows(shaped, bits, axis).reshape(v.shape)

    return hook


@contextmanager
def quantized(model, scheme: str, bits):
    """Within the block, every layer of `model` quantises its cache as SCHEMES[scheme] says."""
    what, axis, where = SCHEMES[scheme]
    config = model.config
    theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 1e4))
    handles = []
    for layer in model.model.layers:
        attn = layer.self_attn
        if what in ("key", "both"):
            hook = _key_hook(bits, axis, where, theta)
            handles.append(attn.k_norm.register_forward_hook(hook))
        if what in ("value", "both"):
            v_axis = "token" if what == "both" else axis
            hook = _value_hook(bits, v_axis, config.num_key_value_heads, attn.head_dim)
            handles.append(attn.v_proj.register_forward_hook(hook))
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


def heldout_windows(tokenizer, count: int = 32, context: int = 128) -> torch.Tensor:
    """The first `count` held-out windows of `context` tokens, [count, context]."""
    return lm_heads.windows(tokenizer, lm.heldout_text(), context, count)


@torch.no_grad()
def mean_loss(model, windows: torch.Tensor) -> float:
    """Mean next-token loss (nats) over windows [N, T]."""
    return lm.token_losses(model, windows.flatten(), windows.shape[1]).double().mean().item()


@torch.no_grad()
def measure(model, windows, schemes=tuple(SCHEMES), bits=BITS) -> dict:
    """{"baseline": loss, scheme: {bits: loss increase}} on windows [N, T]."""
    base = mean_loss(model, windows)
    out = {"baseline": base, "windows": list(windows.shape)}
    for scheme in schemes:
        out[scheme] = {}
        for b in bits:
            with quantized(model, scheme, b):
                out[scheme][str(b)] = mean_loss(model, windows) - base
    return out


@torch.no_grad()
def captured(model, windows):
    """Every layer's keys before RoPE and values, [L, N, T, Hkv, D] each, for windows [N, T]."""
    keys, values, handles = [], [], []
    heads = model.config.num_key_value_heads
    for layer in model.model.layers:
        attn = layer.self_attn
        handles.append(attn.k_norm.register_forward_hook(lambda m, i, k: keys.append(k)))
        handles.append(
            attn.v_proj.register_forward_hook(
                lambda m, i, v: values.append(v.view(*v.shape[:2], heads, -1))
            )
        )
    try:
        model(input_ids=windows)
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(keys), torch.stack(values)


def channel_spread(x: torch.Tensor) -> float:
    """Largest over median of the per-channel RMS of x [..., Hkv, D], pooled over layers."""
    rms = x.double().pow(2).flatten(1, 2).mean(1).sqrt()  # [L, Hkv, D]
    return (rms.flatten(1).amax(1) / rms.flatten(1).median(1).values).max().item()


@torch.no_grad()
def layer_qkv(model, windows, layer: int = 0):
    """Layer `layer`'s queries and keys after their norms (before RoPE) [N, T, H, D] and its
    values [N, T, Hkv, D], for windows [N, T]."""
    store, attn = {}, model.model.layers[layer].self_attn
    handles = [
        getattr(attn, name).register_forward_hook(
            lambda m, i, out, name=name: store.setdefault(name, out)
        )
        for name in ("q_norm", "k_norm", "v_proj")
    ]
    try:
        model(input_ids=windows)
    finally:
        for handle in handles:
            handle.remove()
    v = store["v_proj"]
    return store["q_norm"], store["k_norm"], v.view(*v.shape[:2], -1, attn.head_dim)


def _scores(q, k, theta: float = 1e4):
    """Causal scores [N, H, T, T] in float64 of queries [N, T, H, D] and keys [N, T, Hkv, D],
    both before RoPE (eqs. 8.4, 9.1, 5.1)."""
    q, k = (x.double().transpose(1, 2) for x in (q, k))  # [N, H, T, D]
    cos, sin = rope_cos_sin(torch.arange(q.shape[2]), q.shape[-1], theta)
    q, k = (apply_rope(x, cos.double(), sin.double()) for x in (q, k))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    hidden = ~torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    return (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).masked_fill(hidden, -torch.inf)


def weight_shift(q, k, k_quantised, theta: float = 1e4):
    """Eq. 23.12 row by row, in float64: (sum_j |a'_j - a_j|, its bound e^range - 1), each
    [N, H, T], for causal attention with keys k and with k_quantised (both before RoPE)."""
    z, z2 = _scores(q, k, theta), _scores(q, k_quantised, theta)
    moved = (torch.softmax(z2, -1) - torch.softmax(z, -1)).abs().sum(-1)
    shift = z2 - z  # NaN where both are -inf: the hidden keys
    top = shift.nan_to_num(nan=-torch.inf).amax(-1)
    bottom = shift.nan_to_num(nan=torch.inf).amin(-1)
    return moved, torch.expm1(top - bottom)


def output_shift(q, k, k_quantised, v, theta: float = 1e4):
    """The output's largest change per row, max_f |o'_f - o_f| [N, H, T], and its bound from
    eq. 23.12, sum_j |a'_j - a_j| times the largest |v|, for values v [N, T, Hkv, D] left exact."""
    a, a2 = (torch.softmax(_scores(q, key, theta), -1) for key in (k, k_quantised))
    v = v.double().transpose(1, 2).repeat_interleave(q.shape[2] // v.shape[2], 1)
    change = ((a2 - a) @ v).abs().amax(-1)  # [N, H, T]
    return change, (a2 - a).abs().sum(-1) * v.abs().amax((-2, -1))[..., None]


def row_of(q, k, window: int, head: int, query: int, theta: float = 1e4) -> torch.Tensor:
    """The attention weights [query + 1] of one query of one head, float64."""
    z = _scores(q[window : window + 1], k[window : window + 1], theta)[0, head, query]
    return torch.softmax(z[: query + 1], -1)


def run(count: int = 32) -> dict:
    """Every scheme at 8, 4, 3, 2 bits and fp8 on `count` held-out windows (the chapter's
    table, about 7 s on one thread here)."""
    model, tokenizer = lm.load(attn_implementation="sdpa")
    return measure(model, heldout_windows(tokenizer, count), bits=BITS + ("fp8",))


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(run(), indent=1))
