"""attnlib: scaled dot-product attention from first principles, the book's reference engine.

Importing it is cheap: torch only. The lab (`attnlib.lab`: the Qwen3 check, the benchmark,
memory and timing) and the figures (`attnlib.figures`) import their heavy libraries only when
you import them.
"""

from importlib.metadata import PackageNotFoundError, version

from . import loops
from .attention import attention_weights, causal_attention, repeat_kv
from .cost import (
    attention_flops,
    growth_exponent,
    longest_fitting_length,
    score_matrix_bytes,
    visible_pairs,
)
from .data import SIX_TOKENS, SIX_WORDS
from .heads import KVCache, MultiHeadAttention, merge_heads, split_heads
from .masks import left_padding, sliding_window, visible
from .merge import merge_attention
from .softmax import softmax, softmax_jacobian
from .tiled import tiled_attention

try:
    __version__ = version("attnlib")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "unknown"

# The public names, packed (one a line would double this file).
# fmt: off
__all__ = [
    "KVCache", "MultiHeadAttention", "SIX_TOKENS", "SIX_WORDS", "attention_flops",
    "attention_weights", "causal_attention", "growth_exponent", "left_padding",
    "longest_fitting_length", "loops", "merge_attention", "merge_heads", "repeat_kv",
    "score_matrix_bytes", "sliding_window", "softmax", "softmax_jacobian", "split_heads",
    "tiled_attention", "visible", "visible_pairs",
]
# fmt: on
