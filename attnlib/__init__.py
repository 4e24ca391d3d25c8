"""attnlib: scaled dot-product attention from first principles, the book's reference engine.

Importing it is cheap: torch only. The Qwen3 lab (`attnlib.qwen3`), the plots
(`attnlib.plots`) and the widgets (`attnlib.widgets`) import their heavy libraries
only when you import them.
"""

from . import loops
from .attention import (
    attention_weights,
    causal_attention,
    left_padding,
    merge_heads,
    repeat_kv,
    sliding_window,
    split_heads,
)
from .data import SIX_TOKENS, SIX_WORDS
from .mha import KVCache, MultiHeadAttention
from .softmax import softmax, softmax_jacobian

__all__ = [
    "KVCache",
    "MultiHeadAttention",
    "SIX_TOKENS",
    "SIX_WORDS",
    "attention_weights",
    "causal_attention",
    "left_padding",
    "loops",
    "merge_heads",
    "repeat_kv",
    "sliding_window",
    "softmax",
    "softmax_jacobian",
    "split_heads",
]
__version__ = "0.1.0"
