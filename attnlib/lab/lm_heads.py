"""What the heads of the small language model do: weights, head scores, ablation, generation.

Scores take attention weights [B, H, T, T] (queries as rows) for one layer, or a list over
layers, and return one number per head. Ablation zeroes one head's output before W_O.
"""

import contextlib
import math
from typing import List

import torch
import torch.nn.functional as F

from attnlib import KVCache, causal_attention, merge_heads
from attnlib.rope import apply_rope, rope_cos_sin

from . import attention_interface
from .hf_compat import rope_theta
from .qwen3 import rms_norm

OPENERS = {")": "(", "]": "[", "}": "{"}


@torch.no_grad()
def attention_weights(model, ids: torch.Tensor) -> List[torch.Tensor]:
    """Each layer's weights [B, Hq, T, T] on ids [B, T], from the eager implementation."""
    name = model.config._attn_implementation
    attention_interface.use(model, "eager")
    try:
        return list(model(input_ids=ids, output_attentions=True).attentions)
    finally:
        attention_interface.use(model, name)


def previous_token_score(weights: torch.Tensor) -> torch.Tensor:
    """[B, H, T, T] -> [H]: mean weight from each query i >= 1 on key i - 1."""
    return weights.diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=(0, 2))


def duplicate_token_score(weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[B, H, T, T], ids [B, T] -> [H]: mean total weight on earlier keys holding the query's
    own token, over the queries whose token occurred before."""
    same = ids[:, :, None] == ids[:, None, :]  # [B, T, T]
    earlier = same & torch.ones_like(same).tril(-1)
    rows = earlier.any(-1)  # [B, T]: queries with an earlier copy
    mass = (weights * earlier[:, None]).sum(-1)  # [B, H, T]
    return (mass * rows[:, None]).sum(dim=(0, 2)) / rows.sum()


def bracket_pairs(tokens: List[str]):
    """(query, key) token indices: a token that is one closing bracket, and the token holding
    its matching opener (matched over characters; a pair inside one token is skipped)."""
    stack, pairs = [], []
    for index, token in enumerate(tokens):
        for char in token:
            if char in "([{":
                stack.append((char, index))
            elif char in OPENERS:
                if not stack or stack[-1][0] != OPENERS[char]:
                    stack = []  # unbalanced (the window cut it): start again
                    continue
                _, opener = stack.pop()
                if token.strip("Ġ") == char and opener != index:
                    pairs.append((index, opener))
    return pairs


def bracket_scores(weights: torch.Tensor, pairs_per_row) -> torch.Tensor:
    """[B, H, T, T] and each row's (query, key) pairs -> [2, H]: the mean weight on the
    matching opener, and the share of closers whose largest weight lands on it."""
    mass, hits, count = 0.0, 0.0, 0
    for row, pairs in enumerate(pairs_per_row):
        if not pairs:
            continue
        queries, keys = torch.tensor(pairs).T  # [n] each
        picked = weights[row][:, queries, :]  # [H, n, T]
        on_opener = picked[:, torch.arange(len(keys)), keys]  # [H, n]
        mass = mass + on_opener.sum(-1)
        hits = hits + (picked.argmax(-1) == keys).sum(-1)
        count += len(pairs)
    if count == 0:
        raise ValueError("no closing bracket with its opener in another token: use longer text")
    return torch.stack([mass / count, hits / count])


def first_token_share(weights: torch.Tensor, start: int = 8) -> torch.Tensor:
    """[B, H, T, T] -> [H]: mean weight on key 0 from queries `start`..T-1 (the 'sink')."""
    return weights[:, :, start:, 0].mean(dim=(0, 2))


def induction_score(weights: torch.Tensor, half: int) -> torch.Tensor:
    """Random tokens repeated twice ([B, 2 * half]): mean weight from query half + k on key
    k + 1, the token after the earlier copy of the current token (k = 0..half-2)."""
    queries = torch.arange(half, 2 * half - 1)
    return weights[:, :, queries, queries - half + 1].mean(dim=(0, 2))


def repeated_tokens(tokenizer, half: int, rows: int, seed: int) -> torch.Tensor:
    """[rows, 2 * half] uniform random tokens (no special token), each row repeated twice."""
    generator = torch.Generator().manual_seed(seed)
    first = torch.randint(1, len(tokenizer), (rows, half), generator=generator)
    return torch.cat([first, first], dim=1)


@contextlib.contextmanager
def ablated(model, layer: int, head: int):
    """Zero one query head's output [.., head * D:(head + 1) * D] before W_O, inside `with`."""
    dim = model.config.head_dim
    o_proj = model.model.layers[layer].self_attn.o_proj

    def zero(module, args):
        x = args[0].clone()
        x[..., head * dim : (head + 1) * dim] = 0
        return (x,)

    handle = o_proj.register_forward_pre_hook(zero)
    try:
        yield model
    finally:
        handle.remove()


@torch.no_grad()
def per_token_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, T-1]: loss (nats) of each next token."""
    logits = model(input_ids=ids).logits[:, :-1]
    return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")


# ---------------------------------------------------------------- the book's own decoding


def _manual_layer(layer, x, positions, cache: KVCache, theta: float):
    """One Qwen3 decoder layer by hand: x [B, T, d_model] at `positions` [T] with a KVCache."""
    attention, config = layer.self_attn, layer.self_attn.config
    batch, tokens, _ = x.shape
    dim = attention.head_dim
    h = rms_norm(x, layer.input_layernorm.weight, config.rms_norm_eps)
    q = attention.q_proj(h).view(batch, tokens, -1, dim)  # [B, T, Hq, D]
    k = attention.k_proj(h).view(batch, tokens, -1, dim)  # [B, T, Hkv, D]
    v = attention.v_proj(h).view(batch, tokens, -1, dim).transpose(1, 2)  # [B, Hkv, T, D]
    q = rms_norm(q, attention.q_norm.weight, config.rms_norm_eps).transpose(1, 2)
    k = rms_norm(k, attention.k_norm.weight, config.rms_norm_eps).transpose(1, 2)
    cos, sin = rope_cos_sin(positions, dim, theta)  # [T, D]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # eq. 8.4
    keys, values, key_positions = cache.append(k, v, positions)  # [B, Hkv, S, D]
    y = causal_attention(q, keys, values, query_positions=positions, key_positions=key_positions)
    x = x + attention.o_proj(merge_heads(y))  # eq. 6.2
    h = rms_norm(x, layer.post_attention_layernorm.weight, config.rms_norm_eps)
    return x + layer.mlp(h)


@torch.no_grad()
def cached_generate(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding by hand with one attnlib KVCache per layer: prefill ids [B, T], then
    one token at a time; returns [B, T + new_tokens]."""
    config, theta = model.config, rope_theta(model.config)
    caches = [KVCache() for _ in model.model.layers]
    tokens, step_input, start = ids, ids, 0
    for _ in range(new_tokens):
        positions = torch.arange(start, start + step_input.shape[1])  # [T]
        x = model.model.embed_tokens(step_input)  # [B, T, d_model]
        for layer, cache in zip(model.model.layers, caches):
            x = _manual_layer(layer, x, positions, cache, theta)
        x = rms_norm(x, model.model.norm.weight, config.rms_norm_eps)
        following = model.lm_head(x[:, -1]).argmax(-1, keepdim=True)  # [B, 1]
        tokens = torch.cat([tokens, following], dim=1)
        start += step_input.shape[1]
        step_input = following
    return tokens


def bits(nats: float) -> float:
    return nats / math.log(2)


# ---------------------------------------------------------------- the chapter's measurements


def windows(tokenizer, text: str, context: int, count: int) -> torch.Tensor:
    """The first `count` windows of `context` tokens of `text`: [count, context]."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    if len(ids) < count * context:
        raise ValueError(f"text has {len(ids)} tokens, fewer than {count} x {context}")
    return ids[: count * context].view(count, context)


@torch.no_grad()
def head_scores(model, tokenizer, ids: torch.Tensor, chunk: int = 8) -> dict:
    """Scores of every head over held-out windows ids [N, T]: each a [layers, heads] tensor
    (previous, duplicate, bracket weight, bracket hits, first token)."""
    names = ("previous", "duplicate", "bracket", "bracket_hits", "first_token")
    totals = {name: 0.0 for name in names}
    pairs = [bracket_pairs(tokenizer.convert_ids_to_tokens(row)) for row in ids.tolist()]
    bracket_rows = [sum(len(p) for p in pairs[s : s + chunk]) for s in range(0, len(ids), chunk)]
    for index, start in enumerate(range(0, len(ids), chunk)):
        part, share = ids[start : start + chunk], len(ids[start : start + chunk]) / len(ids)
        layers = attention_weights(model, part)
        totals["previous"] += share * torch.stack([previous_token_score(w) for w in layers])
        dup = torch.stack([duplicate_token_score(w, part) for w in layers])
        totals["duplicate"] += share * dup
        totals["first_token"] += share * torch.stack([first_token_share(w) for w in layers])
        if bracket_rows[index]:
            weight = bracket_rows[index] / sum(bracket_rows)
            found = torch.stack([bracket_scores(w, pairs[start : start + chunk]) for w in layers])
            totals["bracket"] += weight * found[:, 0]
            totals["bracket_hits"] += weight * found[:, 1]
    totals["bracket_pairs"] = sum(bracket_rows)
    return totals


def strongest(scores: torch.Tensor):
    """(layer, head, score) of the largest entry of a [layers, heads] score."""
    index = int(scores.argmax())
    layer, head = divmod(index, scores.shape[1])
    return layer, head, float(scores[layer, head])


def byte_baselines(counts: torch.Tensor, text: str):
    """Bits per byte of `text` under a byte unigram and a byte bigram fitted to the training
    text (`counts` [257, 256] from `lm.byte_counts`), both with add-one smoothing."""
    data = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    counts = counts.double()
    unigram = (counts[:256].sum(0) + counts[256] + 1) / (counts.sum() + 256)
    bigram = (counts[:256] + 1) / (counts[:256].sum(1, keepdim=True) + 256)
    uni_bits = -torch.log2(unigram[data[1:]]).mean()
    bi_bits = -torch.log2(bigram[data[:-1], data[1:]]).mean()
    return float(uni_bits), float(bi_bits)


def uniform_scores(tokenizer, ids: torch.Tensor) -> dict:
    """The scores of eq. 17.2 for a head that spreads its weight evenly over keys 0..i."""
    tokens = ids.shape[1]
    weights = torch.ones(tokens, tokens).tril()
    weights = (weights / weights.sum(-1, keepdim=True)).expand(len(ids), 1, tokens, tokens)
    pairs = [bracket_pairs(tokenizer.convert_ids_to_tokens(row)) for row in ids.tolist()]
    return {
        "previous": float(previous_token_score(weights)[0]),
        "duplicate": float(duplicate_token_score(weights, ids)[0]),
        "bracket": float(bracket_scores(weights, pairs)[0, 0]),
        "first_token": float(first_token_share(weights)[0]),
    }


def closing_targets(tokenizer, ids: torch.Tensor) -> torch.Tensor:
    """[B, T-1] True where the next token (the one predicted) is a single closing bracket."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    closer = torch.tensor([token.strip("Ġ") in OPENERS for token in tokens])
    return closer[ids[:, 1:]]


@torch.no_grad()
def ablation(model, layer: int, head: int, ordinary, closers, repeated, half: int, base=None):
    """Loss increase (nats/token) when one head is zeroed: on ordinary held-out tokens ("other"),
    on the closing brackets among them ("closers"), and on the two copies of repeated tokens."""
    if base is None:  # the intact model's losses on (ordinary, repeated)
        base = per_token_loss(model, ordinary), per_token_loss(model, repeated)
    base, base_rep = base
    with ablated(model, layer, head):
        cut, cut_rep = per_token_loss(model, ordinary), per_token_loss(model, repeated)
    change, change_rep = cut - base, cut_rep - base_rep
    return {
        "other": float(change[~closers].mean()),
        "closers": float(change[closers].mean()),
        "copy 1": float(change_rep[:, : half - 1].mean()),
        "copy 2": float(change_rep[:, half:].mean()),
    }
