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
    visible,
)
from .cost import attention_flops, longest_fitting_length, score_matrix_bytes, visible_pairs
from .data import SIX_TOKENS, SIX_WORDS
from .mha import KVCache, MultiHeadAttention
from .softmax import softmax, softmax_jacobian
from .tiled import tiled_attention

__all__ = [
    "KVCache",
    "MultiHeadAttention",
    "SIX_TOKENS",
    "SIX_WORDS",
    "attention_flops",
    "attention_weights",
    "causal_attention",
    "left_padding",
    "longest_fitting_length",
    "loops",
    "merge_heads",
    "repeat_kv",
    "score_matrix_bytes",
    "sliding_window",
    "softmax",
    "softmax_jacobian",
    "split_heads",
    "tiled_attention",
    "visible",
    "visible_pairs",
]
__version__ = "0.1.0"
