"""Chapter 17, a language model: its loss as bits per byte."""

import math

from .core import Bug, Case, Exercise, Section

CHAPTER = "17_language_model"
LEARNED = Section(CHAPTER, "17.5", "What it learned")

BUGS = {
    "bits_per_token": Bug(
        "The loss became bits per token, not per byte: the total bits are divided by the "
        "tokens where the bytes of the text belong.",
        LEARNED,
    ),
    "nats_not_bits": Bug(
        "The loss stayed in nats: one bit is ln 2 nats, so divide by ln 2.",
        LEARNED,
    ),
}


def _bits_per_byte(loss, tokens, text_bytes, per_byte=True, bits=True):
    total = loss * tokens / (math.log(2) if bits else 1.0)
    return total / (text_bytes if per_byte else tokens)


def _cases():
    sizes = [(4.0, 1000, 3500), (2.3, 512, 2048), (1.0, 100, 100), (0.5, 7, 29)]
    return [Case(s, f"loss={s[0]}, tokens={s[1]}, text_bytes={s[2]}") for s in sizes]


EXERCISES = {
    "bits_per_byte": Exercise(
        "fn(loss, tokens, text_bytes) -> bits; loss in nats per token, counts as ints",
        "The model's loss over a text as bits per byte of that text.",
        _cases,
        _bits_per_byte,
        ("bits (a number)",),
        {
            "bits_per_token": lambda loss, n, size: _bits_per_byte(loss, n, size, per_byte=False),
            "nats_not_bits": lambda loss, n, size: _bits_per_byte(loss, n, size, bits=False),
        },
    ),
}
