"""What a memory recalls: stored key/value pairs read back, and multi-query associative
recall (MQAR, Arora et al., 2023) learned by small models.

`stored_recall` writes N random pairs into one head of width D and reads each key back:
linear attention's sum (eq. 25.2), the delta rule (eq. 25.8) and softmax attention over the
whole cache. `crosstalk_estimate` is eq. (25.7). `train_mqar` trains a one-layer model whose
sequence mixer is softmax attention, linear attention, the delta rule or the gated delta rule,
at the same width and the same budget of steps, and returns its accuracy on fresh sequences.
"""

import math
import time

import torch
import torch.nn.functional as F

from ..delta_rule import delta_rule_chunked, gated_delta_rule_chunked
from ..linear_attention import elu_feature_map

MEMORIES = ("linear", "delta", "softmax")
MIXERS = ("softmax", "linear", "delta", "gated_delta")


def crosstalk_estimate(n: int, d: int) -> float:
    """Eq. (25.7): the expected cosine of a linear memory's read-out to the stored value,
    about 1 / sqrt(1 + (N - 1)/D) for N random unit keys of width D."""
    return 1 / math.sqrt(1 + (n - 1) / d)


def random_store(n: int, d: int, trials: int, seed: int):
    """`trials` stores of N pairs: unit keys [trials, N, D], Gaussian values [trials, N, D]."""
    gen = torch.Generator().manual_seed(seed)
    keys = F.normalize(torch.randn(trials, n, d, generator=gen, dtype=torch.float64), dim=-1)
    values = torch.randn(trials, n, d, generator=gen, dtype=torch.float64)
    return keys, values


def stored_recall(
    n: int, d: int, memory: str, trials: int = 32, seed: int = 0, scale=None, passes: int = 1
):
    """Mean cosine between the read-out of each stored key and its value.

    linear: Omega = sum_j k_j^T v_j, read k_i Omega (eq. 25.2 without psi or normaliser);
    delta: the pairs written in order by the delta rule with eta = 1 (eq. 25.8), `passes`
    times over, read k_i Omega;
    softmax: softmax(scale k_i K^T) V over all N cached pairs, scale 4 sqrt(D) by default.
    """
    keys, values = random_store(n, d, trials, seed)
    if memory == "linear":
        read = keys @ (keys.transpose(-2, -1) @ values)
    elif memory == "delta":
        q, k, v = (u[:, None] for u in (keys, keys, values))  # one head: [trials, 1, N, D]
        eta = torch.ones(trials, 1, n, dtype=torch.float64)
        state = None
        for _ in range(passes):
            _, state = delta_rule_chunked(q, k, v, eta, chunk=64, initial_state=state)
        read = keys @ state[:, 0]
    elif memory == "softmax":
        scale = 4 * math.sqrt(d) if scale is None else scale
        read = torch.softmax(scale * keys @ keys.transpose(-2, -1), dim=-1) @ values
    else:
        raise ValueError(f"memory must be one of {MEMORIES}, got {memory!r}")
    return F.cosine_similarity(read, values, dim=-1).mean().item()


def mqar_batch(n_pairs: int, batch: int, gen, n_keys: int = 64, n_values: int = 64):
    """MQAR sequences: N (key, value) pairs, then the same keys in another order.

    Keys are tokens [0, n_keys), values [n_keys, n_keys + n_values); a key is not repeated
    within a sequence. Returns tokens [batch, 3N] and targets [batch, 3N] (-100 except at
    the queries, where the target is the key's value)."""
    keys = torch.rand(batch, n_keys, generator=gen).argsort(-1)[:, :n_pairs]
    values = n_keys + torch.randint(n_values, (batch, n_pairs), generator=gen)
    order = torch.rand(batch, n_pairs, generator=gen).argsort(-1)
    context = torch.stack([keys, values], dim=-1).reshape(batch, 2 * n_pairs)
    tokens = torch.cat([context, keys.gather(1, order)], dim=1)
    targets = torch.full_like(tokens, -100)
    targets[:, 2 * n_pairs :] = values.gather(1, order)
    return tokens, targets


class RecallModel(torch.nn.Module):
    """One layer: embedding, a sequence mixer of one head of width D, a residual, logits.

    Queries and values come from the token, keys from the token before it (a fixed short
    convolution, so a value is stored under its key), as every mixer gets the same help."""

    def __init__(self, mixer: str, width: int, vocab: int = 128, chunk: int = 32):
        super().__init__()
        if mixer not in MIXERS:
            raise ValueError(f"mixer must be one of {MIXERS}, got {mixer!r}")
        self.mixer, self.chunk = mixer, chunk
        self.embed = torch.nn.Embedding(vocab, width)
        self.qkv = torch.nn.Linear(2 * width, 3 * width, bias=False)
        self.gates = torch.nn.Linear(width, 2)  # eta and alpha, per token
        self.out = torch.nn.Linear(width, width, bias=False)
        self.unembed = torch.nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)  # [B, T, width]
        before = F.pad(x, (0, 0, 1, 0))[:, :-1]  # the previous token's embedding
        q, k, v = self.qkv(torch.cat([x, before], dim=-1)).chunk(3, dim=-1)
        q, k, v = (u[:, None] for u in (q, k, v))  # one head: [B, 1, T, D]
        gate_eta, gate_alpha = self.gates(x).unbind(-1)
        if self.mixer == "softmax":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.mixer == "linear":
            fq, fk = elu_feature_map(q), elu_feature_map(k)
            sim = (fq @ fk.transpose(-2, -1)).tril()
            o = sim @ v / sim.sum(-1, keepdim=True)
        else:
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
            eta = torch.sigmoid(gate_eta)[:, None]
            if self.mixer == "delta":
                o, _ = delta_rule_chunked(q, k, v, eta, chunk=self.chunk)
            else:
                alpha = torch.sigmoid(gate_alpha + 4)[:, None]  # starts near 1
                o, _ = gated_delta_rule_chunked(q, k, v, alpha, eta, chunk=self.chunk)
        return self.unembed(x + self.out(o[:, 0]))


def train_mqar(mixer, n_pairs, width=32, steps=400, batch=64, lr=3e-3, seed=0, test=512):
    """Train one RecallModel on MQAR with N pairs; returns its accuracy on `test` fresh
    sequences, the final training loss and the seconds the training took."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = RecallModel(mixer, width)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    start = time.perf_counter()
    for _ in range(steps):
        tokens, targets = mqar_batch(n_pairs, batch, gen)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    seconds = time.perf_counter() - start
    tokens, targets = mqar_batch(n_pairs, test, torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        guess = model(tokens).argmax(-1)
    asked = targets != -100
    accuracy = (guess[asked] == targets[asked]).double().mean().item()
    return {"accuracy": accuracy, "loss": loss.item(), "seconds": seconds}


GRID = {"width": 16, "pairs": (4, 8, 16, 32), "steps": 1000, "batch": 64, "lr": 1e-2, "seed": 0}
QUICK = {**GRID, "pairs": (4, 8), "steps": 50}
MEASURED = "mqar_measured.json"  # shipped beside this module


def add_arguments(parser) -> None:
    """The options of `python -m attnlib train-mqar`."""
    parser.add_argument("--out", default=None, help=f"JSON report (default: lab/{MEASURED})")
    parser.add_argument("--quick", action="store_true", help="two sizes, 50 steps: a smoke test")


def run(args) -> int:
    """Train every mixer at every N of the grid (one thread); write the JSON report."""
    import json
    import platform
    from pathlib import Path

    torch.set_num_threads(1)
    grid = QUICK if args.quick else GRID
    settings = {k: grid[k] for k in ("width", "steps", "batch", "lr", "seed")}
    rows = []
    for n_pairs in grid["pairs"]:
        for mixer in MIXERS:
            row = {"mixer": mixer, "pairs": n_pairs, **train_mqar(mixer, n_pairs, **settings)}
            print(
                f"{mixer:12s} N={n_pairs:3d} accuracy {row['accuracy']:.3f} "
                f"({row['seconds']:.1f} s)",
                flush=True,
            )
            rows.append(row)
    report = {
        "settings": {
            **settings,
            "pairs": list(grid["pairs"]),
            "threads": 1,
            "keys": 64,
            "values": 64,
            "test_sequences": 512,
        },
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "rows": rows,
    }
    out = Path(args.out) if args.out else Path(__file__).with_name(MEASURED)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0
