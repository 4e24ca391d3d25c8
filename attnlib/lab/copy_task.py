"""Next-token prediction on random tokens, with and without the causal mask (chapter 5).

Tokens drawn uniformly from a vocabulary cannot be predicted: the best honest loss is
ln(vocab). A one-head attention model that may read position t+1 while predicting it can
copy the answer instead and drive the loss towards zero. `train` trains the same small model
(token and position embeddings, one attention head, an unembedding) either way, and returns
its held-out loss and its attention weights on held-out sequences, averaged over them.
"""

from typing import NamedTuple

import torch
from torch import nn

from ..attention import attention_weights, causal_attention


class Setup(NamedTuple):
    """Vocabulary, sequence length, model width, batch, Adam's learning rate and steps."""

    vocab: int = 16
    length: int = 8
    width: int = 16
    batch: int = 32
    lr: float = 3e-2
    steps: int = 100
    held_out: int = 256


class Result(NamedTuple):
    loss: float  # held-out cross-entropy, nats
    weights: torch.Tensor  # [length, length]: attention weights averaged over held-out rows
    snapshots: dict  # step -> [length, length]: the same average on probe rows, during training


class CopyModel(nn.Module):
    """Embeddings + one attention head (eq. 2.2, or eq. 5.1 with the mask) + unembedding."""

    def __init__(self, setup: Setup, causal: bool):
        super().__init__()
        self.causal = causal
        self.embed = nn.Embedding(setup.vocab, setup.width)
        self.where = nn.Embedding(setup.length, setup.width)
        self.w_q, self.w_k, self.w_v = (
            nn.Linear(setup.width, setup.width, bias=False) for _ in range(3)
        )
        self.unembed = nn.Linear(setup.width, setup.vocab)

    def qkv(self, tokens: torch.Tensor):
        """tokens [B, T] -> q, k, v [B, 1, T, width]."""
        h = self.embed(tokens) + self.where.weight[: tokens.shape[1]]  # [B, T, width]
        return tuple(w(h)[:, None] for w in (self.w_q, self.w_k, self.w_v))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, vocab]."""
        y = causal_attention(*self.qkv(tokens), causal=self.causal)  # [B, 1, T, width]
        return self.unembed(y[:, 0])

    def weights(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> attention weights [B, T, T]."""
        q, k, _ = self.qkv(tokens)
        return attention_weights(q, k, causal=self.causal)[:, 0]


def loss_on(model: CopyModel, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token loss on tokens [B, T+1]; the last position is left out, since even an
    unmasked model has nothing to copy there."""
    logits = model(tokens[:, :-1])[:, :-1]  # [B, T-1, vocab]
    targets = tokens[:, 1:-1]  # [B, T-1]
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train(causal: bool, setup: Setup | None = None, seed: int = 0, snapshot_steps=()) -> Result:
    """Train one model (seeded) on fresh random batches; evaluate on held-out sequences.

    `snapshot_steps`: after how many steps (0 = before training) to record the attention
    weights, averaged over probe sequences drawn from a generator of their own, so that
    recording them changes nothing in the training.
    """
    setup = setup or Setup()
    probe_gen = torch.Generator().manual_seed(seed + 1)
    probe = torch.randint(0, setup.vocab, (setup.held_out, setup.length), generator=probe_gen)
    snapshots = {}
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = CopyModel(setup, causal)
    opt = torch.optim.Adam(model.parameters(), lr=setup.lr)

    def batch(n: int) -> torch.Tensor:
        return torch.randint(0, setup.vocab, (n, setup.length + 1), generator=gen)

    for step in range(setup.steps + 1):
        if step in snapshot_steps:
            with torch.no_grad():
                snapshots[step] = model.weights(probe).mean(0)
        if step == setup.steps:
            break
        loss = loss_on(model, batch(setup.batch))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        held_out = batch(setup.held_out)
        weights = model.weights(held_out[:, :-1]).mean(0)
        return Result(loss_on(model, held_out).item(), weights, snapshots)
