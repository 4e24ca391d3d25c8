"""Reading the induction circuit from the weights (chapter 20).

The model is chapter 18's attention-only transformer (eq. 18.1). Vectors are columns here, as
in Elhage et al. (2021): head h of a layer reads the stream through W_Q, W_K, W_V, each
[Dh, d_model] (rows of the layer's linear maps, the transposes of eq. 2.1's d_model x D maps),
and writes through W_O [d_model, Dh]. Its QK matrix W_Q^T W_K (chapter 2's M = W_Q W_K^T in
eq. 2.1's matrices) and OV matrix W_O W_V are [d_model, d_model] (eq. 20.1); E [V, d_model]
embeds, W_U [V, d_model] unembeds. Run `python -m attnlib.lab.circuits` to rewrite the
trained runs shipped in `induction_run/`.
"""

import math
from pathlib import Path
from typing import Dict, NamedTuple, Optional

import torch
import torch.nn.functional as F

from ..heads import merge_heads, split_heads
from . import induction

RUN = Path(__file__).resolve().parent / "induction_run"
CHECKPOINTS = tuple(range(0, 601, 25))  # the chapter's model, every 25 steps
OTHER_SEEDS = (1, 2, 3)  # model seed s, data seed 100 + s, as chapter 18's robustness checks


class Head(NamedTuple):
    """One head's weights: W_Q, W_K, W_V [Dh, d_model] and W_O [d_model, Dh]."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    out: torch.Tensor


def head_weights(model, layer: int, head: int) -> Head:
    """Head `head` of layer `layer` (both from 0): its slices of the layer's linear maps."""
    d_model = model.embed.weight.shape[1]
    width = d_model // model.heads  # Dh
    rows = slice(head * width, (head + 1) * width)
    query_key = model.query_key[layer].weight.detach()  # [2 d_model, d_model]: [W_Q; W_K]
    return Head(
        query_key[:d_model][rows],
        query_key[d_model:][rows],
        model.value[layer].weight.detach()[rows],
        model.out[layer].weight.detach()[:, rows],
    )


def qk_matrix(model, layer: int, head: int) -> torch.Tensor:
    """Eq. 20.1, left: W_QK = W_Q^T W_K [d, d]; query x scores key y x^T W_QK y / sqrt(Dh)."""
    w = head_weights(model, layer, head)
    return w.query.T @ w.key


def ov_matrix(model, layer: int, head: int) -> torch.Tensor:
    """Eq. 20.1, right: W_OV = W_O W_V [d, d]; a head that attends to x writes W_OV x."""
    w = head_weights(model, layer, head)
    return w.out @ w.value


def ov_circuit(model, layer: int, head: int) -> torch.Tensor:
    """Eq. 20.2: the full OV circuit E W_OV^T W_U^T, [V, V]: row s (the attended token) holds the
    logits that the head's write adds when it attends only to token s."""
    embed, unembed = model.embed.weight.detach(), model.unembed.weight.detach()
    return embed @ ov_matrix(model, layer, head).T @ unembed.T


def copying_score(matrix: torch.Tensor) -> float:
    """Eq. 20.3, right, copy_+: the share of the eigenvalues' total magnitude in eigenvalues with
    a positive real part, from 0 to 1; 1 for the identity, 0 for its negative (anti-copying),
    NaN for a zero matrix. A variant of `eigenvalue_copying`. matrix [n, n], in float64."""
    eigenvalues = torch.linalg.eigvals(matrix.double())
    magnitude = eigenvalues.abs()
    return float(magnitude[eigenvalues.real > 0].sum() / magnitude.sum())


def eigenvalue_copying(matrix: torch.Tensor) -> float:
    """Eq. 20.3, left, Elhage et al.'s copy: sum(lambda) / sum(|lambda|) over the eigenvalues,
    from -1 to 1; 1 for the identity, -1 for its negative, NaN for a zero matrix. The sum of
    the eigenvalues of a real matrix is its trace. matrix [n, n], in float64."""
    eigenvalues = torch.linalg.eigvals(matrix.double())
    return float(eigenvalues.sum().real / eigenvalues.abs().sum())


def positional_qk(model, layer: int, head: int) -> torch.Tensor:
    """The scores from positions alone, P W_QK P^T / sqrt(Dh): [T queries, T keys]."""
    positions = model.positions
    width = positions.shape[1] // model.heads
    return positions @ qk_matrix(model, layer, head) @ positions.T / math.sqrt(width)


def composed_qk(model, previous: int, head: int) -> torch.Tensor:
    """Eq. 20.4: the layer-2 head's QK circuit read through the layer-1 head `previous`'s OV,
    E W_QK W_OV E^T / sqrt(Dh): [V, V], row = the query's token, column = the token that the
    layer-1 head wrote at the key (there, the key's previous token)."""
    embed = model.embed.weight.detach()
    width = embed.shape[1] // model.heads
    middle = qk_matrix(model, 1, head) @ ov_matrix(model, 0, previous)
    return embed @ middle @ embed.T / math.sqrt(width)


def composition_score(left: torch.Tensor, right: torch.Tensor) -> float:
    """Eq. 20.5: ||left right||_F / (||left||_F ||right||_F), in float64."""
    left, right = left.double(), right.double()
    return float(
        torch.linalg.norm(left @ right) / (torch.linalg.norm(left) * torch.linalg.norm(right))
    )


def composition_scores(model) -> Dict[str, torch.Tensor]:
    """K-, Q- and V-composition of every layer-1 head into every layer-2 head (eq. 20.5):
    {"K": [H1, H2], "Q": ..., "V": ...}; K reads W_QK W_OV, Q W_QK^T W_OV, V W_OV W_OV."""
    heads = model.heads
    tables = {name: torch.zeros(heads, heads, dtype=torch.float64) for name in "KQV"}
    for first in range(heads):
        writes = ov_matrix(model, 0, first)
        for second in range(heads):
            qk, ov = qk_matrix(model, 1, second), ov_matrix(model, 1, second)
            tables["K"][first, second] = composition_score(qk, writes)
            tables["Q"][first, second] = composition_score(qk.T, writes)
            tables["V"][first, second] = composition_score(ov, writes)
    return tables


def random_composition(d_model: int, width: int, samples: int, generator) -> torch.Tensor:
    """Eq. 20.5 for `samples` draws of Gaussian W_Q, W_K, W_V, W_O, W_V', W_O' of one head's
    shapes ([width, d_model] and [d_model, width]): the K-composition scores, [samples]."""
    scores = torch.empty(samples, dtype=torch.float64)
    for i in range(samples):
        q, k, v = (torch.randn(width, d_model, generator=generator) for _ in range(3))
        o = torch.randn(d_model, width, generator=generator)
        scores[i] = composition_score(q.T @ k, o @ v)
    return scores


# Patching: one head's write to the stream, replaced in chosen readers only.

READERS = ("query", "key", "value")


def head_write(model, tokens: torch.Tensor, layer: int, head: int) -> torch.Tensor:
    """What head `head` of `layer` adds to the residual stream on tokens [B, T]: [B, T, d]."""
    return patched_logits(model, tokens, (layer, head), None, ())[1]


def patched_logits(model, tokens, head, replacement: Optional[torch.Tensor], into=()):
    """Eq. 18.1 run by hand, with the write of head = (layer, h) replaced by `replacement`
    [B, T, d] (or [1, T, d]) in the readers named in `into` only: pairs (layer, "query" | "key" |
    "value") and "logits". Returns (logits [B, T, V], the head's own write [B, T, d]).
    With nothing to replace it computes what `model(tokens)` computes, bit for bit."""
    source_layer, source_head = head
    x = model.embed(tokens)  # [B, T, d]
    where = model.positions[: tokens.shape[1]]  # [T, d]
    delta, write = None, None
    width = x.shape[-1] // model.heads
    layers = zip(model.query_key, model.value, model.out)
    for layer, (query_key, value, out) in enumerate(layers):
        read = {
            name: x + delta if delta is not None and (layer, name) in into else x
            for name in READERS
        }
        if read["query"] is read["key"]:
            q, k = query_key(read["query"] + where).chunk(2, -1)  # [B, T, d] each
        else:
            q = query_key(read["query"] + where).chunk(2, -1)[0]
            k = query_key(read["key"] + where).chunk(2, -1)[1]
        v = value(read["value"])
        q, k, v = (split_heads(t, model.heads) for t in (q, k, v))
        y = model.attention(q, k, v)  # [B, H, T, Dh]
        x = x + out(merge_heads(y))  # the real stream keeps the real write
        if layer == source_layer:
            rows = slice(source_head * width, (source_head + 1) * width)
            write = y[:, source_head] @ out.weight[:, rows].T  # [B, T, d]
            if replacement is not None:
                delta = replacement - write
    if delta is not None and "logits" in into:
        return model.unembed(x + delta), write
    return model.unembed(x), write


def copied_loss(logits: torch.Tensor, data: induction.CopyBatch) -> float:
    """The mean loss on the copied tokens (chapter 18's split) of logits [B, T, V]."""
    losses = F.cross_entropy(
        logits[:, :-1].transpose(1, 2), data.tokens[:, 1:], reduction="none"
    )  # [B, T-1]
    return losses[data.copied].mean().item()


@torch.no_grad()
def patching_table(model, data: induction.CopyBatch, head=(0, 0)) -> Dict[str, float]:
    """The copied-token loss with the layer-1 head `head`'s write replaced: by its mean over the
    batch (per position) or by its write on another sequence of the batch, in layer 2's key, query
    or value input only; and, as whole-head ablations, zero or mean everywhere downstream."""
    tokens = data.tokens
    write = head_write(model, tokens, *head)  # [B, T, d]
    mean = write.mean(0, keepdim=True)  # [1, T, d]
    shuffled = write.roll(1, 0)  # the write on the previous sequence of the batch
    table = {"none": copied_loss(patched_logits(model, tokens, head, None)[0], data)}
    downstream = {(1, name) for name in READERS} | {"logits"}
    for name in ("key", "query", "value"):
        for label, replacement in (("mean", mean), ("shuffled", shuffled)):
            logits = patched_logits(model, tokens, head, replacement, {(1, name)})[0]
            table[f"{name} only, {label}"] = copied_loss(logits, data)
    for label, replacement in (("zero", torch.zeros_like(mean)), ("mean", mean)):
        logits = patched_logits(model, tokens, head, replacement, downstream)[0]
        table[f"whole head, {label}"] = copied_loss(logits, data)
    return table


# An induction circuit written by hand.

PAIRS = 8  # sine-cosine pairs of the positions that the hand-built layer 1 reads


def step_back(d_model: int, pairs: int = PAIRS) -> torch.Tensor:
    """[2 pairs, 2 pairs]: rotates the first `pairs` sine-cosine pairs of position i (eq. 18.1's
    P, frequencies w_k = 10000^(-2k/d_model)) into those of position i - 1 (eq. 20.6)."""
    rotation = torch.zeros(2 * pairs, 2 * pairs, dtype=torch.float64)
    for k in range(pairs):
        w = 10000.0 ** (-2 * k / d_model)
        c, s = math.cos(w), math.sin(w)
        rotation[2 * k : 2 * k + 2, 2 * k : 2 * k + 2] = torch.tensor([[c, -s], [s, c]])
    return rotation.float()  # (sin pw, cos pw) -> (sin (p-1)w, cos (p-1)w)


def hand_built(setup: Optional[induction.Setup] = None) -> induction.AttentionOnly:
    """Chapter 18's model with d_model = 2 PAIRS + 3 V and every weight set by hand: layer 1,
    head 0 copies the previous token into its own block; layer 2, head 0 matches the query's
    token against it and copies the token it finds to the logits. Heads 1 are zero."""
    setup = induction.Setup() if setup is None else setup
    vocab, p = setup.vocab, 2 * PAIRS
    d_model = p + 3 * vocab
    model = induction.make_model(0, setup._replace(d_model=d_model))
    eye = torch.eye(vocab)
    position, token = slice(0, p), slice(p, p + vocab)
    previous, output = slice(p + vocab, p + 2 * vocab), slice(p + 2 * vocab, d_model)
    head = slice(0, vocab)  # the first vocab features of head 0
    with torch.no_grad():
        for weight in model.parameters():
            weight.zero_()
        model.embed.weight[:, token] = 20 * eye
        first, second = (layer.weight for layer in model.query_key)
        first[0:p, position] = 8 * step_back(d_model)
        first[d_model : d_model + p, position] = 8 * torch.eye(p)
        model.value[0].weight[head, token] = eye
        model.out[0].weight[previous, head] = eye
        second[head, token] = eye
        second[d_model : d_model + vocab, previous] = eye
        model.value[1].weight[head, token] = eye
        model.out[1].weight[output, head] = eye
        model.unembed.weight[:, output] = 0.4 * eye
    return model.eval()


class Claims(NamedTuple):
    """The chapter's thresholds on the circuits of a trained model."""

    copies: float = 0.9  # the induction heads' copy_+ scores (eq. 20.3) are above this
    previous_copies: float = 0.1  # the previous-token head's is below this: it anti-copies
    k_over_random: float = 1.0  # K-composition above this times the largest random score
    patched_above: float = 0.8  # key-only and whole-head patches: loss above this times ln V
    other_within: float = 0.05  # query-only, value-only: within this times ln V of no patch
    offset_upto: int = 20  # positional QK peaks at offset -1 for every query 1 .. this - 1
    diagonal_rows: int = 30  # composed QK peaks on the diagonal for at least this many tokens


def offset_peaks(model, head: int) -> list:
    """The queries i >= 1 whose positional QK scores (layer 1, `head`) peak at key i - 1."""
    scores = positional_qk(model, 0, head)
    length = scores.shape[0]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    best = scores.masked_fill(~causal, -math.inf).argmax(1)  # [T]
    return [i for i in range(1, length) if best[i] == i - 1]


def diagonal_peaks(model, previous: int, head: int) -> int:
    """How many query tokens the composed QK circuit (eq. 20.4) scores highest on themselves."""
    scores = composed_qk(model, previous, head)
    return int((scores.argmax(1) == torch.arange(scores.shape[0])).sum())


def failed_circuit_claims(model, data, random_largest: float, limits=None) -> list:
    """The claims of `limits` (default Claims()) that a trained model fails on data; [] if none.
    The previous-token head is the layer-1 head with the largest eq. 18.2 score."""
    limits, log_v = Claims() if limits is None else limits, math.log(model.unembed.weight.shape[0])
    first = induction.attention_patterns(model, data.tokens)[0]
    previous = int(induction.previous_token_score(first).argmax())
    heads = range(model.heads)
    tables = composition_scores(model)
    patched = patching_table(model, data, (0, previous))
    others = [patched[f"{n} only, {r}"] for n in ("query", "value") for r in ("mean", "shuffled")]
    numbers = [*patched.values(), *(float(t.abs().max()) for t in tables.values())]
    checks = {
        "every number finite": all(math.isfinite(x) for x in numbers),
        "induction heads copy": all(
            copying_score(ov_circuit(model, 1, h)) > limits.copies for h in heads
        ),
        "previous-token head anti-copies": copying_score(ov_circuit(model, 0, previous))
        < limits.previous_copies,
        "K-composition": bool(tables["K"][previous].min() > limits.k_over_random * random_largest),
        "Q, V below K": bool(
            max(tables["Q"][previous].max(), tables["V"][previous].max())
            < tables["K"][previous].min()
        ),
        "key-only patch": min(patched["key only, mean"], patched["key only, shuffled"])
        > limits.patched_above * log_v,
        "whole-head ablation": min(patched["whole head, zero"], patched["whole head, mean"])
        > limits.patched_above * log_v,
        "query, value patches": max(abs(o - patched["none"]) for o in others)
        < limits.other_within * log_v,
        "positional QK": set(range(1, limits.offset_upto)) <= set(offset_peaks(model, previous)),
        "composed QK": all(
            diagonal_peaks(model, previous, h) >= limits.diagonal_rows for h in heads
        ),
    }
    return [name for name, holds in checks.items() if not holds]


# The shipped training run.


def train_run(seed: int = 0, steps=CHECKPOINTS):
    """Chapter 18's two-layer model and training (model seed `seed`, data seed 100 + seed),
    with checkpoints at `steps`: {step: state_dict}."""
    setup = induction.Setup()
    model = induction.make_model(seed, setup)
    history = induction.train(model, setup, seed=100 + seed, checkpoints=steps)
    return history.checkpoints


def write_run(folder: Path = RUN) -> None:
    """Trains and saves the chapter's run (every checkpoint) and the other seeds' final models."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(train_run(0), folder / "seed0.pt")
    for seed in OTHER_SEEDS:
        final = train_run(seed, steps=(induction.Setup().steps,))
        torch.save(final, folder / f"seed{seed}.pt")


def load_run(seed: int = 0, folder: Path = RUN) -> Dict[int, induction.AttentionOnly]:
    """The shipped models of one training run: {step: model}, chapter 18's sizes."""
    states = torch.load(folder / f"seed{seed}.pt", weights_only=True)
    models = {}
    for step, state in states.items():
        model = induction.make_model(seed)
        model.load_state_dict(state)
        models[step] = model.eval()
    return models


if __name__ == "__main__":
    torch.set_num_threads(1)
    write_run()
    print(f"wrote {sorted(p.name for p in RUN.iterdir())}")
