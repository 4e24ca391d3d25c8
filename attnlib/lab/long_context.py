"""Chapter 24's lab: past the training length, checked against transformers and measured.

* `rope_config`, `set_rope`: a RoPE rule set through a model's config, as a user does it;
* `loss_by_position`: the book's checkpoint (chapter 19) on windows longer than it was trained;
* `bloom_check`, `smollm3_nope_check`, `gptoss_check`: attnlib against BLOOM's ALiBi,
  SmolLM3's NoPE layer and gpt-oss's sinks with sliding windows, on small random configs;
* `first_token_share`: how much attention the first token takes, for the sink question;
* `PositionModel`, `train_length`: small copy-task models with RoPE, ALiBi or no positions,
  trained at one length and evaluated at longer ones (`python -m attnlib train-length`).
"""

import copy
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..alibi import alibi_attention, alibi_bias, alibi_slopes
from ..attention import causal_attention
from ..heads import merge_heads, split_heads
from ..masks import sliding_window
from ..rope import apply_rope
from ..rope_scaling import scaled_cos_sin, scaled_frequencies
from . import hf_compat, induction

LENGTH_RUN = Path(__file__).resolve().parent / "length_run"  # shipped: `train-length`


# --- RoPE rules through the config ---------------------------------------------------------


def rope_config(rule: str, head_dim: int, theta: float, max_positions: int, **params):
    """A small Qwen3Config whose RoPE follows `rule` with Hugging Face's parameter names."""
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        vocab_size=64,
        num_hidden_layers=1,
        intermediate_size=32,
        **hf_compat.rope_fields(rule, theta, params),
    )


def set_rope(model, rule: str, **params):
    """A copy of a Qwen3 causal LM whose config says `rule`; its rotary layer is rebuilt from
    that config, as `from_pretrained(..., rope_parameters=...)` would build it."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    model = copy.copy(model)  # shallow: the weights are shared, the rotary layer is not
    model.model = copy.copy(model.model)
    config = copy.deepcopy(model.config)
    theta = _theta(config)
    for key, value in hf_compat.rope_fields(rule, theta, params).items():
        setattr(config, key, value)
    model.config = model.model.config = config
    model.model.rotary_emb = Qwen3RotaryEmbedding(config=config)
    return model


def _theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


@torch.no_grad()
def loss_by_position(model, ids: torch.Tensor, context: int, windows: int) -> torch.Tensor:
    """Mean next-token loss (nats) at each position of `windows` windows of `context` tokens
    cut from ids [N]: [context - 1], entry p the loss of predicting token p + 1."""
    rows = ids[: windows * context].view(windows, context)  # [n, context]
    out = []
    for chunk in rows.split(8):
        logits = model(input_ids=chunk).logits[:, :-1]  # [b, context-1, V]
        out.append(F.cross_entropy(logits.transpose(1, 2), chunk[:, 1:], reduction="none"))
    return torch.cat(out).double().mean(0)


def range_means(per_position: torch.Tensor, edges) -> list:
    """Means of per-position losses over [edges[n], edges[n+1]) for each n."""
    return [per_position[a:b].mean().item() for a, b in zip(edges[:-1], edges[1:])]


# --- ALiBi against BLOOM --------------------------------------------------------------------


def _bloom(heads: int, head_dim: int, seed: int):
    from transformers import BloomConfig
    from transformers.models.bloom.modeling_bloom import BloomAttention

    config = BloomConfig(
        hidden_size=heads * head_dim,
        n_head=heads,
        n_layer=1,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        vocab_size=32,
    )
    torch.manual_seed(seed)
    layer = BloomAttention(config, layer_idx=0).eval()
    for p in layer.parameters():
        nn.init.normal_(p, std=0.1)
    return layer


def bloom_slopes(heads: int) -> torch.Tensor:
    """BLOOM's slopes [H], read off `build_alibi_tensor` at key position 1 (its public API)."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    keep = torch.ones(1, 2, dtype=torch.long)
    return build_alibi_tensor(keep, heads, torch.float32).view(heads, 2)[:, 1]


@torch.no_grad()
def bloom_check(heads: int, length: int = 12, pad: int = 3, head_dim: int = 8, seed: int = 0):
    """(slopes gap, bias gap, layer-output gap) between attnlib and BLOOM: the slopes, the bias
    as BLOOM's `build_alibi_tensor` makes it up to a per-row constant, and BloomAttention's
    output, on a batch of two rows, the second left-padded by `pad` tokens."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    slopes = alibi_slopes(heads)
    slope_gap = (slopes - bloom_slopes(heads)).abs().max().item()
    keep = torch.ones(2, length, dtype=torch.long)
    keep[1, :pad] = 0
    positions = (keep.cumsum(-1) - 1).clamp(min=0)  # [B, S]: padding does not count
    theirs = build_alibi_tensor(keep, heads, torch.float32).view(2, heads, 1, length)
    ours = alibi_bias(slopes, positions, positions)  # [B, H, T, S]
    real = keep.bool()[:, None, None, :]
    # BLOOM adds slope * pos(k_j); ours is -slope * (pos(q_i) - pos(k_j)): one constant a row
    bias_gap = (ours + slopes.view(1, -1, 1, 1) * positions[:, None, :, None]) - theirs
    bias_gap = bias_gap.masked_fill(~real, 0).abs().max().item()
    layer = _bloom(heads, head_dim, seed)
    x = torch.randn(2, length, heads * head_dim, generator=torch.Generator().manual_seed(seed))
    allowed = (positions[:, None, :, None] >= positions[:, None, None, :]) & real  # [B,1,T,S]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = allowed & causal
    additive = torch.zeros(2, 1, length, length).masked_fill(~allowed, torch.finfo().min)
    out, _ = layer(x, torch.zeros_like(x), theirs.reshape(2 * heads, 1, length), additive)
    q, k, v = layer.query_key_value(x).view(2, length, heads, 3, head_dim).unbind(3)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
    got = alibi_attention(q, k, v, slopes, positions, positions, allowed=real & causal)
    got = layer.dense(merge_heads(got))
    rows = keep.bool()  # padded queries see nothing in attnlib and differ by design
    layer_gap = (got - out)[rows].abs().max().item()
    return slope_gap, bias_gap, layer_gap


# --- NoPE against SmolLM3 -------------------------------------------------------------------


def smollm3_config(layers: int = 8, heads: int = 4, head_dim: int = 16):
    """A small SmolLM3Config: RoPE in three layers of four, none in every fourth (NoPE)."""
    from transformers import SmolLM3Config

    return SmolLM3Config(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=2,
        num_hidden_layers=layers,
        intermediate_size=32,
        vocab_size=32,
        head_dim=head_dim,
        attn_implementation="eager",
    )


@torch.no_grad()
def smollm3_nope_check(layer_idx: int = 3, length: int = 10, seed: int = 0) -> float:
    """Largest gap between SmolLM3's attention layer `layer_idx` (a NoPE layer: RoPE off)
    and attnlib's causal attention with no rotation at all."""
    from transformers.models.smollm3.modeling_smollm3 import SmolLM3Attention

    config = smollm3_config()
    if config.no_rope_layers[layer_idx]:
        raise ValueError(f"layer {layer_idx} uses RoPE: {config.no_rope_layers}")
    torch.manual_seed(seed)
    layer = SmolLM3Attention(config, layer_idx).eval()
    x = torch.randn(1, length, config.hidden_size)
    junk = torch.randn(1, length, config.head_dim)  # angles a NoPE layer must ignore
    mask = torch.zeros(1, 1, length, length).masked_fill(
        ~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf")
    )
    out, _ = layer(x, position_embeddings=(junk, junk), attention_mask=mask)
    q = split_heads(layer.q_proj(x), config.num_attention_heads)
    k = split_heads(layer.k_proj(x), config.num_key_value_heads)
    v = split_heads(layer.v_proj(x), config.num_key_value_heads)
    got = layer.o_proj(merge_heads(causal_attention(q, k, v)))
    return (got - out).abs().max().item()


# --- gpt-oss: a learned sink per head, sliding windows ------------------------------------


def gptoss_model(seed: int = 0, window: int = 4):
    """A two-layer GptOssModel with random weights: layer 0 a sliding window, layer 1 full."""
    from transformers import GptOssConfig, GptOssModel

    config = GptOssConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        intermediate_size=32,
        vocab_size=32,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=window,
        attn_implementation="eager",
        layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(seed)
    model = GptOssModel(config).eval()
    with torch.no_grad():
        for layer in model.layers:
            for p in layer.self_attn.parameters():
                p.normal_(0, 0.3)
            layer.self_attn.sinks.normal_(0, 2)
    return model


@torch.no_grad()
def gptoss_check(seed: int = 0, window: int = 4, length: int = 12) -> list:
    """Per layer, the largest gap (over the largest output) between GptOssAttention's output in a
    GptOssModel and
    attnlib's causal attention with the same sinks, window and RoPE (its yarn rule)."""
    model = gptoss_model(seed, window)
    config = model.config
    seen = []

    def grab(module, args, kwargs, output):
        seen.append((module, kwargs["hidden_states"], output[0]))

    hooks = [
        layer.self_attn.register_forward_hook(grab, with_kwargs=True) for layer in model.layers
    ]
    ids = torch.randint(32, (1, length), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    params = dict(_rope_params(config))
    rule, theta = params.pop("rope_type"), params.pop("rope_theta")
    inv_freq, factor = scaled_frequencies(rule, config.head_dim, theta, **params)
    cos, sin = scaled_cos_sin(torch.arange(length), inv_freq, factor)
    gaps = []
    for module, x, out in seen:
        q = apply_rope(split_heads(module.q_proj(x), config.num_attention_heads), cos, sin)
        k = apply_rope(split_heads(module.k_proj(x), config.num_key_value_heads), cos, sin)
        v = split_heads(module.v_proj(x), config.num_key_value_heads)
        allowed = None
        if module.sliding_window is not None:
            allowed = sliding_window(torch.arange(length), torch.arange(length), window)
        got = causal_attention(q, k, v, allowed=allowed, sinks=module.sinks)
        gaps.append(((module.o_proj(merge_heads(got)) - out).abs().max() / out.abs().max()).item())
    return gaps


def _rope_params(config):
    """gpt-oss's RoPE as scaled_frequencies' keywords (yarn with T_train and no truncation)."""
    params = getattr(config, "rope_parameters", None)
    if not params:  # transformers 4.x
        params = {**(config.rope_scaling or {}), "rope_theta": config.rope_theta}
    rule = params.get("rope_type", params.get("type", "default"))
    out = {"rope_type": rule, "rope_theta": float(params["rope_theta"])}
    if rule == "yarn":
        out.update(
            factor=float(params["factor"]),
            train_length=int(params["original_max_position_embeddings"]),
            fast=params.get("beta_fast") or 32,
            slow=params.get("beta_slow") or 1,
            truncate=params.get("truncate", True),
        )
    return out.items()


# --- sinks in the book's models -------------------------------------------------------------


def first_token_share(weights: torch.Tensor, start: int = 16):
    """weights [B, H, T, T] -> ([H] mean weight on key 0 over queries i >= start,
    the mean of 1/(i+1) over the same queries: what an even spread would give)."""
    share = weights[:, :, start:, 0].double().mean((0, 2))
    even = (1.0 / torch.arange(start + 1, weights.shape[-1] + 1, dtype=torch.float64)).mean()
    return share, even.item()


@torch.no_grad()
def lm_weights(model, ids: torch.Tensor):
    """Every layer's attention weights of a Qwen3 causal LM on ids [B, T], eager: a list of
    [B, H, T, T]."""
    from .attention_interface import use

    eager = use(model, "eager")
    return list(eager(input_ids=ids, output_attentions=True).attentions)


# --- length generalisation on the copy task -------------------------------------------------

POSITIONS = ("rope", "alibi", "nope")


class PositionModel(nn.Module):
    """Chapter 18's attention-only model (eq. 17.1) with its positions moved into attention:
    RoPE on queries and keys (eq. 8.4), ALiBi's bias (eq. 24.5), or none (NoPE). No position
    table, so it runs at any length. tokens [B, T] -> logits [B, T, V]."""

    def __init__(self, vocab: int, positions: str, d_model=32, heads=2, layers=2):
        super().__init__()
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")
        self.positions, self.heads = positions, heads
        self.embed = nn.Embedding(vocab, d_model)
        self.qkv = nn.ModuleList(nn.Linear(d_model, 3 * d_model, bias=False) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(d_model, d_model, bias=False) for _ in range(layers))
        self.unembed = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)  # [B, T, d_model]
        length, width = tokens.shape[1], x.shape[-1] // self.heads
        slopes = alibi_slopes(self.heads)
        cos, sin = scaled_cos_sin(torch.arange(length), scaled_frequencies("default", width)[0])
        for qkv, out in zip(self.qkv, self.out):
            q, k, v = (split_heads(t, self.heads) for t in qkv(x).chunk(3, -1))
            if self.positions == "rope":
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if self.positions == "alibi":
                y = alibi_attention(q, k, v, slopes)
            else:
                y = causal_attention(q, k, v)
            x = x + out(merge_heads(y))
        return self.unembed(x)


def copied_loss(model, setup: induction.Setup, length: int, seed: int, batch: int = 256):
    """Mean loss on the copied tokens of `batch` fresh copy-task rows of `length` tokens."""
    data = induction.copy_task(
        batch, length, setup.vocab, setup.segment, torch.Generator().manual_seed(seed)
    )
    with torch.no_grad():
        logits = model(data.tokens)[:, :-1]
    losses = F.cross_entropy(logits.transpose(1, 2), data.tokens[:, 1:], reduction="none")
    return losses[data.copied].mean().item()


def train_length(
    out=LENGTH_RUN,
    steps: int = 1500,
    seed: int = 0,
    lengths=(32, 64, 128),
    heads: int = 8,
    d_model: int = 64,
    kinds=POSITIONS,
    lr: float = 1e-2,
):
    """Train one PositionModel per kind on chapter 18's copy task at its length (32 tokens),
    evaluate at each of `lengths`, and save weights and results in `out`."""
    torch.set_num_threads(1)
    setup = induction.Setup(steps=steps, heads=heads, d_model=d_model, lr=lr)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"setup": setup._asdict(), "seed": seed, "lengths": list(lengths), "runs": {}}
    for kind in kinds:
        torch.manual_seed(seed)
        model = PositionModel(setup.vocab, kind, setup.d_model, setup.heads)
        generator = torch.Generator().manual_seed(100 + seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr)
        start = time.perf_counter()
        for _ in range(steps):
            data = induction.task_batch(setup, setup.batch, generator)
            logits = model(data.tokens)[:, :-1]
            loss = F.cross_entropy(logits.transpose(1, 2), data.tokens[:, 1:])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        seconds = time.perf_counter() - start
        model.eval()
        losses = [copied_loss(model, setup, n, 1000 + seed) for n in lengths]
        torch.save(model.state_dict(), out / f"{kind}.pt")
        results["runs"][kind] = {"copied_loss": losses, "train_seconds": seconds}
        print(kind, [round(x, 3) for x in losses], f"{seconds:.1f} s", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return results


def load_length_model(kind: str, path=LENGTH_RUN):
    """A shipped PositionModel of `train_length`, eval mode."""
    results = json.loads((Path(path) / "results.json").read_text())
    setup = induction.Setup(**results["setup"])
    model = PositionModel(setup.vocab, kind, setup.d_model, setup.heads)
    model.load_state_dict(torch.load(Path(path) / f"{kind}.pt", weights_only=True))
    return model.eval(), setup, results


@torch.no_grad()
def copy_task_first_token(seeds=(0, 1, 2, 3), start: int = 16) -> dict:
    """model name -> ([heads of every layer] mean weight on key 0 from queries i >= start,
    an even spread's), for chapter 18's shipped copy-task models (every seed, trained) and this
    chapter's `length_run` models, on one batch of chapter 18's task."""
    from .circuits import RUN

    data = induction.task_batch(induction.Setup(), 64, torch.Generator().manual_seed(5))
    found = {}
    for seed in seeds:
        states = torch.load(RUN / f"seed{seed}.pt", weights_only=False)
        model = induction.make_model(seed)
        model.load_state_dict(states[max(states)])
        found[f"chapter 18, seed {seed}"] = induction.attention_patterns(model, data.tokens)
    for kind in POSITIONS:
        model, _, _ = load_length_model(kind)
        found[f"{kind}, length run"] = position_patterns(model, data.tokens)
    out = {}
    for name, patterns in found.items():
        shares = [first_token_share(weights, start) for weights in patterns]
        out[name] = (torch.cat([share for share, _ in shares]), shares[0][1])
    return out


@torch.no_grad()
def position_patterns(model: "PositionModel", tokens: torch.Tensor, logits: bool = False):
    """Every layer's attention weights [B, H, T, T] of a PositionModel on tokens [B, T], as a
    list; with logits=True, (that list, the logits [B, T, V] of the same pass)."""
    x = model.embed(tokens)
    length, width = tokens.shape[1], x.shape[-1] // model.heads
    cos, sin = scaled_cos_sin(torch.arange(length), scaled_frequencies("default", width)[0])
    slopes, out = alibi_slopes(model.heads), []
    for qkv, proj in zip(model.qkv, model.out):
        q, k, v = (split_heads(t, model.heads) for t in qkv(x).chunk(3, -1))
        if model.positions == "rope":
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        scores = q @ k.transpose(-1, -2) / width**0.5
        if model.positions == "alibi":
            pos = torch.arange(length)[None]
            scores = scores + alibi_bias(slopes, pos, pos)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out.append(weights)
        x = x + proj(merge_heads(weights @ v))
    return (out, model.unembed(x)) if logits else out


def rope_gap(rule: str, head_dim: int, theta: float, train_length: int, ratio: float) -> float:
    """Largest relative gap between attnlib's (frequencies, attention factor) for `rule` and
    transformers' ROPE_INIT_FUNCTIONS[rule] on a config with the same numbers (Llama 3's rule
    with its published 1 and 4 as low_freq_factor and high_freq_factor)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params, ours = {"factor": ratio}, {"factor": ratio}
    if rule == "llama3":
        params.update(low_freq_factor=1.0, high_freq_factor=4.0)
        ours.update(low_freq_factor=1.0, high_freq_factor=4.0)
    if rule in ("yarn", "llama3"):
        params["original_max_position_embeddings"] = train_length
    if rule != "linear":
        ours["train_length"] = train_length
    config = rope_config(rule, head_dim, theta, int(train_length * ratio), **params)
    if rule == "dynamic":  # the dynamic rule reads T_train from the config's length
        config.max_position_embeddings = train_length
    got = scaled_frequencies(rule, head_dim, theta, **ours)
    want = ROPE_INIT_FUNCTIONS[rule](config, None)
    return max((got[0] / want[0] - 1).abs().max().item(), abs(got[1] - want[1]) / want[1])
