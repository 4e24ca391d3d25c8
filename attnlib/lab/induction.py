"""Induction heads (chapter 18): an attention-only transformer trained on a copy task.

The model is eq. 18.1: token embeddings start a residual stream, to which every layer's
multi-head attention (eqs. 6.1-6.2) adds its output; fixed sinusoidal positions enter the
queries and keys only; an unembedding gives the logits. The probes are the head scores of
eq. 18.2. Sequences are [B, T] tokens; heads are [B, H, T, Dh].
"""

import copy
import math
from typing import Dict, List, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import attention_weights
from ..heads import merge_heads, split_heads
from ..tiled import tiled_attention


class Setup(NamedTuple):
    """The chapter's task, model and training: sizes, AdamW's learning rate, steps."""

    vocab: int = 32
    length: int = 32
    segment: int = 10
    d_model: int = 32
    heads: int = 2
    batch: int = 64
    lr: float = 2e-2
    steps: int = 600


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """PyTorch's fused causal attention, the reference: q, k, v [B, H, T, D] -> [B, H, T, D]."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sinusoidal_positions(length: int, d_model: int) -> torch.Tensor:
    """[T, d_model]: row p holds sin(p w_i) in even and cos(p w_i) in odd features,
    w_i = 10000^(-2i/d_model) (Vaswani et al.)."""
    if d_model % 2:
        raise ValueError(f"d_model ({d_model}) must be even: sines and cosines come in pairs")
    frequencies = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * frequencies  # [T, d_model/2]
    return torch.stack([angles.sin(), angles.cos()], -1).flatten(1).float()  # [T, d_model]


class AttentionOnly(nn.Module):
    """Eq. 18.1: x = E[tokens]; per layer x += MHA(x), queries and keys read x + P, values x;
    logits = x W_U. tokens [B, T] -> logits [B, T, V]; `attention`: q, k, v [B, H, T, Dh]."""

    def __init__(self, vocab, length, d_model=32, heads=2, layers=2, attention=tiled_attention):
        super().__init__()
        if vocab < 2 or length < 2 or layers < 1 or heads < 1 or d_model % heads:
            raise ValueError(
                f"need vocab >= 2, length >= 2, layers >= 1 and d_model ({d_model}) a multiple "
                f"of heads ({heads}); got vocab={vocab}, length={length}, layers={layers}"
            )
        self.heads, self.attention = heads, attention
        self.embed = nn.Embedding(vocab, d_model)  # E: token -> its row of the residual stream
        self.register_buffer("positions", sinusoidal_positions(length, d_model))  # P [T, d]
        self.query_key = nn.ModuleList(
            nn.Linear(d_model, 2 * d_model, bias=False) for _ in range(layers)
        )  # [W_Q | W_K] of each layer
        self.value = nn.ModuleList(nn.Linear(d_model, d_model, bias=False) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(d_model, d_model, bias=False) for _ in range(layers))
        self.unembed = nn.Linear(d_model, vocab, bias=False)  # W_U: stream -> logits

    def forward(self, tokens, ablate=(), patterns: Optional[list] = None):
        """tokens [B, T] -> logits [B, T, V]. ablate: (layer, head) pairs whose output is zeroed;
        patterns: a list to which each layer's weights [B, H, T, T] are appended."""
        if tokens.dim() != 2 or not 0 < tokens.shape[1] <= len(self.positions):
            raise ValueError(
                f"tokens must be [B, T] with 1 <= T <= {len(self.positions)}, "
                f"got {list(tokens.shape)}"
            )
        x = self.embed(tokens)  # [B, T, d_model]: the residual stream starts as the tokens
        where = self.positions[: tokens.shape[1]]  # [T, d_model]
        for layer, (query_key, value, out) in enumerate(zip(self.query_key, self.value, self.out)):
            q, k = query_key(x + where).chunk(2, -1)  # [B, T, d_model] each
            v = value(x)  # [B, T, d_model]: the values carry no position
            q, k, v = (split_heads(t, self.heads) for t in (q, k, v))  # [B, H, T, Dh]
            y = self.attention(q, k, v)  # [B, H, T, Dh], eqs. 2.2 and 6.1
            if patterns is not None:
                patterns.append(attention_weights(q, k).detach())  # [B, H, T, T]
            keep = [(layer, h) not in ablate for h in range(self.heads)]
            if not all(keep):  # zero the ablated heads' outputs
                y = y * torch.tensor(keep, dtype=y.dtype)[:, None, None]
            x = x + out(merge_heads(y))  # eq. 18.1: the layer adds to the residual stream
        return self.unembed(x)  # [B, T, V]


def make_model(seed: int, setup: Optional[Setup] = None, layers=2, **options) -> AttentionOnly:
    """An `AttentionOnly` model of `setup`'s sizes (default: `Setup()`), its weights drawn after
    torch.manual_seed(seed)."""
    setup = Setup() if setup is None else setup
    torch.manual_seed(seed)
    sizes = dict(d_model=setup.d_model, heads=setup.heads, layers=layers)
    return AttentionOnly(setup.vocab, setup.length, **{**sizes, **options})


class CopyBatch(NamedTuple):
    """tokens [B, T]; copied [B, T-1]: prediction t (of token t+1) is a predictable copy;
    source, target [B]: where the segment was read from and where it was written."""

    tokens: torch.Tensor
    copied: torch.Tensor
    source: torch.Tensor
    target: torch.Tensor


def copy_task(batch: int, length: int, vocab: int, segment: int, generator) -> CopyBatch:
    """Random tokens [B, T] with `segment` of them copied from a random earlier place to a random
    later place (so the offset varies); every draw comes from `generator`."""
    if segment < 2 or 2 * segment > length:
        raise ValueError(f"segment ({segment}) must be at least 2 and fit twice in {length}")
    tokens = torch.randint(vocab, (batch, length), generator=generator)  # [B, T]
    target = torch.randint(segment, length - segment + 1, (batch,), generator=generator)
    room = (target - segment + 1).double()  # the segment may start anywhere in 0..target-segment
    source = (torch.rand(batch, generator=generator, dtype=torch.float64) * room).long()
    pos = torch.arange(length)  # [T]
    inside = (pos >= target[:, None]) & (pos < target[:, None] + segment)  # [B, T]
    read = torch.where(inside, pos - target[:, None] + source[:, None], pos)  # [B, T]
    tokens = tokens.gather(1, read)  # the copy: token target+j is token source+j
    copied = inside[:, 1:] & (pos[1:] > target[:, None])  # after the segment's first token
    return CopyBatch(tokens, copied, source, target)


def task_batch(setup: Setup, batch: int, generator) -> CopyBatch:
    """`copy_task` with `setup`'s length, vocabulary and segment: [B, T] tokens."""
    return copy_task(batch, setup.length, setup.vocab, setup.segment, generator)


def token_losses(model: nn.Module, data: CopyBatch, ablate=()) -> torch.Tensor:
    """Cross-entropy of each next-token prediction, [B, T-1] (position t predicts token t+1)."""
    logits = model(data.tokens, ablate=ablate)[:, :-1]  # [B, T-1, V]
    return F.cross_entropy(logits.transpose(1, 2), data.tokens[:, 1:], reduction="none")


def split_losses(losses: torch.Tensor, copied: torch.Tensor):
    """(mean loss on the copied tokens, mean loss on all other tokens) of losses [B, T-1]."""
    return losses[copied].mean(), losses[~copied].mean()


class History(NamedTuple):
    """Per step: copied and other losses; checkpoints: step -> state_dict after that step."""

    copied: List[float]
    other: List[float]
    checkpoints: Dict[int, dict]


def train(model, setup: Setup, seed: int, steps=None, checkpoints=(), on_step=None) -> History:
    """AdamW on the mean next-token loss over every token of fresh, seeded copy-task batches.

    on_step(step, loss, model) is called after each backward, before the update; checkpoint 0
    is the untrained model."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr)
    history = History([], [], {})
    if 0 in checkpoints:
        history.checkpoints[0] = copy.deepcopy(model.state_dict())
    for step in range(1, (setup.steps if steps is None else steps) + 1):
        data = task_batch(setup, setup.batch, generator)
        losses = token_losses(model, data)  # [B, T-1]
        optimizer.zero_grad()
        losses.mean().backward()
        if on_step is not None:
            on_step(step, losses.mean(), model)
        optimizer.step()
        copied, other = split_losses(losses.detach(), data.copied)
        history.copied.append(copied.item())
        history.other.append(other.item())
        if step in checkpoints:
            history.checkpoints[step] = copy.deepcopy(model.state_dict())
    return history


def smoothed(values: List[float], window: int) -> List[float]:
    """Means over consecutive windows of `window` steps: [mean of 1..w, mean of w+1..2w, ...]."""
    starts = range(0, len(values) - window + 1, window)
    return [sum(values[i : i + window]) / window for i in starts]


@torch.no_grad()
def evaluate(model: nn.Module, data: CopyBatch, ablate=()):
    """(copied-token loss, other-token loss) of the model on data, as floats, with no graph."""
    copied, other = split_losses(token_losses(model, data, ablate), data.copied)
    return copied.item(), other.item()


@torch.no_grad()
def attention_patterns(model: nn.Module, tokens: torch.Tensor) -> List[torch.Tensor]:
    """Every layer's attention weights on tokens [B, T]: a list of [B, H, T, T], one per layer."""
    patterns: list = []
    model(tokens, patterns=patterns)
    return patterns


def previous_token_score(weights: torch.Tensor) -> torch.Tensor:
    """Eq. 18.2, left: each head's mean weight from query i to key i-1; [B, H, T, T] -> [H]."""
    return weights.diagonal(offset=-1, dim1=-2, dim2=-1).mean((0, 2))


def induction_score(weights: torch.Tensor, data: CopyBatch) -> torch.Tensor:
    """Eq. 18.2, right: each head's mean weight from a copied query t to key t - offset + 1, the
    token after the earlier occurrence of token t; weights [B, H, T, T] -> [H]."""
    row, query = data.copied.nonzero(as_tuple=True)  # query t predicts the copied token t+1
    key = query - (data.target - data.source)[row] + 1  # [N]
    return weights[row, :, query, key].mean(0)  # [N, H] -> [H]


class Evidence(NamedTuple):
    """What the chapter asserts about a trained pair of models, on one evaluation batch."""

    copied_two: float  # copied-token loss of the 2-layer model
    copied_one: float  # ... of the 1-layer model
    previous: torch.Tensor  # eq. 18.2 previous-token score of each layer-1 head, [H]
    induction: torch.Tensor  # eq. 18.2 induction score of each layer-2 head, [H]
    ablated: float  # copied-token loss with the best previous-token head zeroed
    control: float  # ... with every other layer-1 head zeroed instead


def evidence(two: AttentionOnly, one: AttentionOnly, data: CopyBatch) -> Evidence:
    """The chapter's measurements of two trained models (2 layers, 1 layer) on data."""
    first, second = attention_patterns(two, data.tokens)[:2]  # [B, H, T, T] each
    previous = previous_token_score(first)
    head = int(previous.argmax())
    others = {(0, h) for h in range(two.heads) if h != head}
    return Evidence(
        evaluate(two, data)[0],
        evaluate(one, data)[0],
        previous,
        induction_score(second, data),
        evaluate(two, data, ablate={(0, head)})[0],
        evaluate(two, data, ablate=others)[0],
    )


class Thresholds(NamedTuple):
    """The chapter's claims, as fractions of ln V (losses) and as attention weights (scores)."""

    two_below: float = 0.4  # the 2-layer copied-token loss is below this times ln V
    one_above: float = 0.7  # the 1-layer model's stays above this times ln V
    previous: float = 0.5  # some layer-1 head's previous-token score is above this
    induction: float = 0.5  # some layer-2 head's induction score is above this
    ablated_above: float = 0.7  # zeroing that layer-1 head lifts the loss above this times ln V


def failed_claims(found: Evidence, vocab: int, limits: Optional[Thresholds] = None) -> List[str]:
    """The claims of `limits` (default: `Thresholds()`) that `found` fails; [] if all hold."""
    limits, log_v = Thresholds() if limits is None else limits, math.log(vocab)
    checks = {
        "2-layer copied loss": found.copied_two < limits.two_below * log_v,
        "1-layer copied loss": found.copied_one > limits.one_above * log_v,
        "previous-token head": float(found.previous.max()) > limits.previous,
        "induction head": float(found.induction.max()) > limits.induction,
        "ablation": found.ablated > limits.ablated_above * log_v,
        "control ablation": found.control < limits.two_below * log_v,
    }
    return [name for name, holds in checks.items() if not holds]


def previous_weight_by_position(weights: torch.Tensor, data: CopyBatch):
    """A head's weight on the previous token, by query position, split by where the query is.

    weights [B, T, T] (one head); returns (in_copy, elsewhere), each [T]: at position t, the mean
    of weights[b, t, t-1] over the sequences whose query t predicts a copied token, and over the
    others. NaN where a group is empty (position 0 has no previous token)."""
    batch, length = weights.shape[0], weights.shape[-1]
    back = torch.full((batch, length), math.nan)
    back[:, 1:] = weights.diagonal(offset=-1, dim1=-2, dim2=-1)  # [B, T-1]: key t-1 of query t
    in_copy = torch.zeros(batch, length, dtype=torch.bool)
    in_copy[:, :-1] = data.copied  # query t predicts the copied token t+1

    def mean_where(selected):  # [B, T] bool -> [T]
        total = torch.where(selected, back, 0.0).sum(0)
        return total / selected.sum(0)  # 0/0 = NaN where nothing is selected

    return mean_where(in_copy), mean_where(~in_copy)
