"""What the heads of the small language model do: weights, head scores, ablation, generation,
and chapter 20's circuit readings applied to it (composition scores, patching one input).

Scores take attention weights [B, H, T, T] (queries as rows) for one layer, or a list over
layers, and return one number per head. Ablation zeroes one head's output before W_O. Layers
and heads are numbered from 0 in code; the chapters print layers from 1.
"""

import contextlib
import math
from typing import Dict, List

import torch
import torch.nn.functional as F

from attnlib import KVCache, causal_attention, merge_heads
from attnlib.rope import apply_rope, rope_cos_sin

from . import attention_interface
from .circuits import composition_score
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
    """The scores of eq. 19.2 for a head that spreads its weight evenly over keys 0..i."""
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


def _closer_ids(tokenizer) -> torch.Tensor:
    """[V] True for the tokens that are a single closing bracket (a space before it allowed)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return torch.tensor([token.strip("Ġ") in OPENERS for token in tokens])


def closing_targets(tokenizer, ids: torch.Tensor) -> torch.Tensor:
    """[B, T-1] True where the next token (the one predicted) is a single closing bracket: the
    query is the token before the closer."""
    return _closer_ids(tokenizer)[ids[:, 1:]]


def closer_queries(tokenizer, ids: torch.Tensor) -> torch.Tensor:
    """[B, T-1] True where the query itself (position i, predicting token i + 1) is a single
    closing bracket: the queries of eq. 19.2's bracket score."""
    return _closer_ids(tokenizer)[ids[:, :-1]]


def bracket_breakdown(weights: torch.Tensor, tokens_per_row) -> dict:
    """One head's weights [B, T, T] and each row's tokens -> one entry per pair of eq. 19.2's
    bracket score (`bracket_pairs`), each a tensor [N]: `distance` from the closer back to its
    opener; `nested`, True when another token holding an opening bracket lies between them;
    `on_opener`, True when the closer's largest weight is on its opener; `on_nearest`, True
    when it is on the nearest earlier token that holds any bracket, opening or closing."""
    found = {name: [] for name in ("distance", "nested", "on_opener", "on_nearest")}
    for row, tokens in enumerate(tokens_per_row):
        holds = [any(char in "([{" for char in token) for token in tokens]
        brackets = [any(char in "([{)]}" for char in token) for token in tokens]
        for query, key in bracket_pairs(tokens):
            best = int(weights[row, query].argmax())
            nearest = max(j for j in range(query) if brackets[j])
            found["distance"].append(query - key)
            found["nested"].append(any(holds[key + 1 : query]))
            found["on_opener"].append(best == key)
            found["on_nearest"].append(best == nearest)
    return {name: torch.tensor(values) for name, values in found.items()}


@torch.no_grad()
def ablation(model, layer: int, head: int, ordinary, groups: dict, repeated, half: int, base=None):
    """Loss increase (nats/token) when one head is zeroed: on each group of ordinary held-out
    predictions (`groups`: name -> [B, T-1] bool), on the predictions in none of them
    ("other"), and on the two copies of repeated tokens ("copy 1", "copy 2")."""
    if base is None:  # the intact model's losses on (ordinary, repeated)
        base = per_token_loss(model, ordinary), per_token_loss(model, repeated)
    base, base_rep = base
    with ablated(model, layer, head):
        cut, cut_rep = per_token_loss(model, ordinary), per_token_loss(model, repeated)
    change, change_rep = cut - base, cut_rep - base_rep
    rest = ~torch.stack(list(groups.values())).any(0)  # [B, T-1]
    return {
        "other": float(change[rest].mean()),
        **{name: float(change[mask].mean()) for name, mask in groups.items()},
        "copy 1": float(change_rep[:, : half - 1].mean()),
        "copy 2": float(change_rep[:, half:].mean()),
    }


# ---------------------------------------------------------------- chapter 20's readings


def head_circuits(model, layer: int, head: int):
    """Eq. 20.1 for query head `head` of a Qwen3 layer: (W_QK, W_OV), each [d_model, d_model],
    vectors as columns. The RMSNorm gains (input, q_norm, k_norm) are folded in; RoPE's
    rotation and the norms' division by the root mean square are left out."""
    block = model.model.layers[layer]
    attention, gain = block.self_attn, block.input_layernorm.weight.detach()
    dim = model.config.head_dim
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    kv = head // group  # GQA: query head h reads key-value head h // group
    rows, kv_rows = slice(head * dim, (head + 1) * dim), slice(kv * dim, (kv + 1) * dim)
    w_q = attention.q_proj.weight.detach()[rows] * gain  # [D, d_model]
    w_k = attention.k_proj.weight.detach()[kv_rows] * gain
    w_v = attention.v_proj.weight.detach()[kv_rows] * gain
    w_o = attention.o_proj.weight.detach()[:, rows]  # [d_model, D]
    norms = attention.q_norm.weight.detach() * attention.k_norm.weight.detach()  # [D]
    return w_q.T @ (norms[:, None] * w_k), w_o @ w_v


def composition(model, source, layer: int) -> Dict[str, torch.Tensor]:
    """Eq. 20.5 from head `source` = (layer, head) into every query head of `layer`:
    {"K": [Hq], "Q": [Hq], "V": [Hq]}, with `head_circuits`' matrices."""
    writes = head_circuits(model, *source)[1]
    heads = model.config.num_attention_heads
    tables = {name: torch.zeros(heads, dtype=torch.float64) for name in "KQV"}
    for head in range(heads):
        qk, ov = head_circuits(model, layer, head)
        tables["K"][head] = composition_score(qk, writes)
        tables["Q"][head] = composition_score(qk.T, writes)
        tables["V"][head] = composition_score(ov, writes)
    return tables


@torch.no_grad()
def head_write(model, ids: torch.Tensor, layer: int, head: int) -> torch.Tensor:
    """What one query head adds to the residual stream on ids [B, T]: [B, T, d_model]."""
    dim, seen = model.config.head_dim, {}
    o_proj = model.model.layers[layer].self_attn.o_proj
    columns = slice(head * dim, (head + 1) * dim)

    def keep(module, args):
        seen["y"] = args[0][..., columns]  # [B, T, D]: the head's output before W_O

    handle = o_proj.register_forward_pre_hook(keep)
    try:
        model(input_ids=ids)
    finally:
        handle.remove()
    return seen["y"] @ o_proj.weight[:, columns].T


INPUTS = {"query": "q_proj", "key": "k_proj", "value": "v_proj"}


@torch.no_grad()
def patched_loss(model, ids, source, replacement, reader: int, inputs=()) -> torch.Tensor:
    """Per-token loss [B, T-1] with the write of head `source` = (layer, head) replaced by
    `replacement` [B or 1, T, d_model] in the named inputs ("query", "key", "value") of layer
    `reader` only; the rest of the model, that layer's other inputs included, reads the real
    write. With no inputs named it is `per_token_loss`."""
    if reader <= source[0]:
        raise ValueError(
            f"reader layer {reader} must come after the head's layer {source[0]}: a layer reads "
            "only what the layers below it wrote"
        )
    unknown = set(inputs) - set(INPUTS)
    if unknown:
        raise ValueError(f"inputs must be among {sorted(INPUTS)}, got {sorted(unknown)}")
    delta = replacement - head_write(model, ids, *source)  # [B, T, d_model]
    block, seen = model.model.layers[reader], {}
    norm = block.input_layernorm

    def keep(module, args):
        seen["x"] = args[0]  # the residual stream that the layer reads

    def swap(module, args):
        return (rms_norm(seen["x"] + delta, norm.weight, norm.variance_epsilon),)

    handles = [norm.register_forward_pre_hook(keep)]
    for name in inputs:
        projection = getattr(block.self_attn, INPUTS[name])
        handles.append(projection.register_forward_pre_hook(swap))
    try:
        return per_token_loss(model, ids)
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def patching_table(model, repeated, half: int, source, reader: int) -> Dict[str, tuple]:
    """(loss on copy 1, loss on copy 2) of repeated tokens [B, 2 half] with the write of head
    `source` replaced in one input of layer `reader`: by its mean over the batch (per position)
    or by its write on another row (the batch rolled by one); plus no patch, and the head
    zeroed everywhere (`ablated`)."""

    def copies(loss):  # [B, 2 half - 1] -> the two copies' mean losses
        return float(loss[:, : half - 1].mean()), float(loss[:, half:].mean())

    write = head_write(model, repeated, *source)
    replacements = {"mean": write.mean(0, keepdim=True), "shuffled": write.roll(1, 0)}
    table = {"none": copies(per_token_loss(model, repeated))}
    for name in INPUTS:
        for label, replacement in replacements.items():
            loss = patched_loss(model, repeated, source, replacement, reader, (name,))
            table[f"{name} only, {label}"] = copies(loss)
    with ablated(model, *source):
        table["whole head, zero"] = copies(per_token_loss(model, repeated))
    return table
