"""A small Qwen3 language model trained here on Python's standard library source.

The corpus and its split, the BPE tokenizer, training through attnlib's attention (registered
with transformers, see `attention_interface`), saving and loading the checkpoint with
`from_pretrained`, and held-out loss in bits per byte.
"""

import csv
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path
from typing import List, NamedTuple, Optional

import torch
import torch.nn.functional as F

from . import attention_interface

CHECKPOINT = Path(__file__).resolve().parent / "stdlib_lm"  # shipped as package data
EOS = "<|endoftext|>"
LICENCE = "PSF-2.0 (Python Software Foundation License Version 2)"
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")


class Settings(NamedTuple):
    """Everything that decides a training run (saved in the manifest)."""

    vocab_size: int = 2048
    hidden_size: int = 128
    layers: int = 4
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    context: int = 128
    batch: int = 32
    steps: int = 1000
    lr: float = 3e-3
    warmup: int = 60
    weight_decay: float = 0.1
    heldout_bytes: int = 250_000  # held-out files are taken until their text reaches this
    max_files: Optional[int] = None  # None: every top-level module
    repeat_fraction: float = 0.0  # share of training windows given a repeated segment
    threads: int = 1
    rope_theta: float = 10000.0


TINY = Settings(
    vocab_size=300, hidden_size=32, layers=2, q_heads=4, kv_heads=2, head_dim=8,
    intermediate_size=64, context=32, batch=8, steps=40, lr=1e-2, warmup=5,
    heldout_bytes=20_000, max_files=12, threads=1,
)  # fmt: skip


# ---------------------------------------------------------------- corpus and tokenizer


def stdlib_files(max_files: Optional[int] = None) -> List[Path]:
    """The top-level `*.py` modules of the running Python's standard library, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"), key=lambda p: p.name)
    if not files:
        raise FileNotFoundError(f"no standard-library modules found in {root}")
    return files[:max_files] if max_files else files


def split(files: List[Path], heldout_bytes: int):
    """(train, heldout): every 10th file (from the 5th) is held out until `heldout_bytes`."""
    heldout, size = [], 0
    for path in files[5::10]:
        if size >= heldout_bytes:
            break
        heldout.append(path)
        size += path.stat().st_size
    train = [path for path in files if path not in heldout]
    return train, heldout


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(texts: List[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on `texts`, wrapped for `AutoTokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS, bos_token=EOS, pad_token=EOS
    )


def encode_documents(tokenizer, texts: List[str]) -> torch.Tensor:
    """All documents as one stream of token ids, each followed by the end-of-text token."""
    ids = []
    for encoded in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids += encoded + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def token_bytes(tokenizer) -> torch.Tensor:
    """[V] the number of UTF-8 bytes each token stands for (0 for the end-of-text token)."""
    sizes = torch.zeros(len(tokenizer), dtype=torch.long)
    for token, index in tokenizer.get_vocab().items():
        sizes[index] = 0 if token == EOS else len(token)  # byte-level: one char per byte
    return sizes


# ---------------------------------------------------------------- the model


def make_config(settings: Settings, vocab_size: int, attn_implementation: str = "sdpa"):
    """A small `Qwen3Config`: GQA, RoPE, QK-norm, tied embeddings."""
    from transformers import Qwen3Config

    from .hf_compat import rope_keywords

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size,
        num_hidden_layers=settings.layers,
        num_attention_heads=settings.q_heads,
        num_key_value_heads=settings.kv_heads,
        head_dim=settings.head_dim,
        max_position_embeddings=settings.context,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        attn_implementation=attn_implementation,
        **rope_keywords(settings.rope_theta),
    )


def add_repeats(windows: torch.Tensor, fraction: float, generator) -> torch.Tensor:
    """Give a `fraction` of the rows a repeated segment: tokens [a, a+L) copied to [b, b+L)."""
    rows, length = windows.shape
    chosen = torch.rand(rows, generator=generator) < fraction
    for row in chosen.nonzero().flatten().tolist():
        segment = int(torch.randint(8, length // 4 + 1, (1,), generator=generator))
        start = int(torch.randint(0, length // 2 - segment + 1, (1,), generator=generator))
        to = int(torch.randint(start + segment, length - segment + 1, (1,), generator=generator))
        windows[row, to : to + segment] = windows[row, start : start + segment].clone()
    return windows


def lr_at(step: int, settings: Settings) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    done = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


def train_model(model, data: torch.Tensor, settings: Settings, seed: int, progress=True):
    """AdamW on random windows of `data`; returns the loss of every step (nats/token)."""
    from tqdm import tqdm

    generator = torch.Generator().manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": other}]
    optimizer = torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    span = settings.context + 1
    losses = []
    bar = tqdm(range(settings.steps), desc="train-lm", unit="step", disable=not progress)
    model.train()
    for step in bar:
        starts = torch.randint(0, len(data) - span, (settings.batch,), generator=generator)
        windows = torch.stack([data[s : s + span] for s in starts.tolist()])  # [B, T+1]
        if settings.repeat_fraction:
            windows = add_repeats(windows, settings.repeat_fraction, generator)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, settings)
        logits = model(input_ids=windows[:, :-1]).logits  # [B, T, V]
        loss = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return losses


@torch.no_grad()
def token_losses(model, ids: torch.Tensor, context: int, batch: int = 64) -> torch.Tensor:
    """Per-token loss (nats) of `ids` [N] cut into windows of `context` tokens; [n, context-1]."""
    usable = (len(ids) // context) * context
    windows = ids[:usable].view(-1, context)  # [n, context]
    out = []
    for chunk in windows.split(batch):
        logits = model(input_ids=chunk).logits[:, :-1]  # [b, context-1, V]
        out.append(F.cross_entropy(logits.transpose(1, 2), chunk[:, 1:], reduction="none"))
    return torch.cat(out)


def bits_per_byte(losses: torch.Tensor, targets: torch.Tensor, sizes: torch.Tensor) -> float:
    """Total loss in bits over the bytes the target tokens stand for."""
    return float(losses.double().sum() / math.log(2) / sizes[targets].sum())


def byte_counts(texts: List[str]) -> torch.Tensor:
    """[257, 256] byte bigram counts: row 256 counts each text's first byte (unigram start)."""
    counts = torch.zeros(257, 256, dtype=torch.long)
    for text in texts:
        data = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
        if len(data) == 0:
            continue
        counts[256, data[0]] += 1
        counts[:256].view(-1).index_add_(
            0, data[:-1] * 256 + data[1:], torch.ones(len(data) - 1, dtype=torch.long)
        )
    return counts


# ---------------------------------------------------------------- the command


def _write_curve(path: Path, losses: List[float]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["step", "loss"])
        writer.writerows((i + 1, f"{loss:.5f}") for i, loss in enumerate(losses))


def _compat_config(path: Path, settings: Settings) -> None:
    """Make config.json readable by transformers 4.51 too: it reads `rope_theta` and
    `torch_dtype`, where transformers 5 writes `rope_parameters` and `dtype`."""
    config = json.loads(path.read_text())
    config.setdefault("rope_theta", settings.rope_theta)
    config.setdefault("torch_dtype", config.get("dtype", "float32"))
    config["attn_implementation"] = "sdpa"  # loads with no registration; attnlib's is set later
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer_config = path.parent / "tokenizer_config.json"
    config = json.loads(tokenizer_config.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # v5 writes a name 4.51 lacks
    config["model_max_length"] = settings.context
    tokenizer_config.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _corpus(settings: Settings):
    """(train files, held-out files, training texts, held-out text with end-of-text marks)."""
    train_files, heldout_files = split(stdlib_files(settings.max_files), settings.heldout_bytes)
    heldout_text = "".join(read(p) + EOS for p in heldout_files)
    return train_files, heldout_files, [read(p) for p in train_files], heldout_text


def _save(out: Path, model, tokenizer, settings: Settings, texts, heldout_text, losses) -> None:
    """Write the checkpoint: weights, tokenizer, configs, held-out text, counts, loss curve."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _compat_config(out / "config.json", settings)
    (out / "heldout.txt").write_text(heldout_text, encoding="utf-8")
    counts = {"bigram": byte_counts(texts).to(torch.int32)}
    save_file(counts, out / "byte_counts.safetensors")
    _write_curve(out / "loss_curve.csv", losses)


def _files(paths: List[Path]):
    return [[p.name, p.stat().st_size, _sha(p)] for p in paths]


def _manifest(settings, train_files, heldout_files, texts, heldout_text, run: dict) -> dict:
    """What the checkpoint was trained on, and how, with the run's measurements."""
    corpus = {
        "corpus": "top-level modules of the Python standard library (sysconfig stdlib)",
        "licence": LICENCE,
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "train_files": _files(train_files),
        "heldout_files": _files(heldout_files),
        "train_bytes": sum(len(t.encode()) for t in texts),
        "heldout_bytes": len(heldout_text.encode()),
        "split": "every 10th file from the 5th, sorted by name, held out up to "
        f"{settings.heldout_bytes} bytes; the tokenizer saw the training files only",
        "settings": settings._asdict(),
        "torch": torch.__version__,
        "threads": settings.threads,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    return {**corpus, **run}


def train(out: str, seed: int = 0, settings: Optional[Settings] = None, progress=True) -> dict:
    """Build the corpus and tokenizer, train, evaluate and save everything into `out`."""
    from transformers import Qwen3ForCausalLM

    settings = Settings() if settings is None else settings
    started, threads = time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        out = Path(out)
        train_files, heldout_files, texts, heldout_text = _corpus(settings)
        tokenizer = train_tokenizer(texts, settings.vocab_size)
        data = encode_documents(tokenizer, texts)
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(make_config(settings, len(tokenizer)))
        attention_interface.use(model)  # training runs through tiled_attention's backward
        trained_at = time.perf_counter()
        losses = train_model(model, data, settings, seed, progress)
        train_seconds = time.perf_counter() - trained_at
        attention_interface.use(model, "sdpa")
        heldout_ids = encode_documents(tokenizer, [read(p) for p in heldout_files])
        heldout = token_losses(model, heldout_ids, settings.context)
        targets = heldout_ids[: heldout.shape[0] * settings.context].view(-1, settings.context)
        _save(out, model, tokenizer, settings, texts, heldout_text, losses)
        bits = bits_per_byte(heldout, targets[:, 1:], token_bytes(tokenizer))
        run = {
            "train_tokens": len(data),
            "heldout_tokens": len(heldout_ids),
            "seed": seed,
            "parameters": sum(p.numel() for p in model.parameters()),
            "train_seconds": round(train_seconds, 1),
            "total_seconds": round(time.perf_counter() - started, 1),
            "final_train_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
            "heldout_loss": round(float(heldout.mean()), 4),
            "heldout_bits_per_byte": round(bits, 4),
        }
        manifest = _manifest(settings, train_files, heldout_files, texts, heldout_text, run)
        (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        return manifest
    finally:
        torch.set_num_threads(threads)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


# ---------------------------------------------------------------- loading


def checkpoint_path(path=None) -> Path:
    return CHECKPOINT if path is None else Path(path)


def load(path=None, attn_implementation: str = "attnlib"):
    """(model, tokenizer) from a checkpoint folder with `from_pretrained`, offline.

    Raises FileNotFoundError for a missing file, ValueError for a corrupt file or a tokenizer
    whose vocabulary does not fit the model's embedding.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = checkpoint_path(path)
    missing = [name for name in REQUIRED if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"checkpoint {path} lacks {', '.join(missing)}: retrain it with "
            "`python -m attnlib train-lm --out DIR` or reinstall attnlib"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as err:  # safetensors, json and tokenizers each raise their own kind
        raise ValueError(f"checkpoint {path} is corrupt or unreadable: {first_line(err)}") from err
    if len(tokenizer) != model.config.vocab_size:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens but the model's config.json says vocab_size="
            f"{model.config.vocab_size}: they come from different checkpoints"
        )
    model.eval()
    return attention_interface.use(model, attn_implementation), tokenizer


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def encode(tokenizer, text: str, context: int) -> torch.Tensor:
    """[1, T] token ids of `text`; a ValueError if T exceeds the model's context."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    if ids.shape[1] > context:
        raise ValueError(
            f"prompt has {ids.shape[1]} tokens but the model was trained on {context}: "
            "shorten it or keep its last tokens"
        )
    return ids


def heldout_text(path=None) -> str:
    return (checkpoint_path(path) / "heldout.txt").read_text(encoding="utf-8")


def manifest(path=None) -> dict:
    return json.loads((checkpoint_path(path) / "manifest.json").read_text())


def loss_curve(path=None):
    """(steps, losses) of the training run, from the checkpoint's loss_curve.csv."""
    with (checkpoint_path(path) / "loss_curve.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    return [int(row["step"]) for row in rows], [float(row["loss"]) for row in rows]
