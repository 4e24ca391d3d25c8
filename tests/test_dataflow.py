"""The data-flow picture of chapter 2 (attnlib.figures.dataflow): deterministic, shape-checked."""

import math

import pytest
import torch

import attnlib
from attnlib import SIX_TOKENS, SIX_WORDS

pytest.importorskip("matplotlib")

from attnlib.figures.dataflow import dataflow  # noqa: E402
from attnlib.figures.plots import plt, png_bytes  # noqa: E402


def layer(d_k=2, d_v=4, seed=123):
    g = torch.Generator().manual_seed(seed)
    x = SIX_TOKENS
    Q, K, V = (x @ torch.randn(3, w, generator=g) for w in (d_k, d_k, d_v))
    Z = Q @ K.T / math.sqrt(d_k)
    A = attnlib.softmax(Z, dim=-1)
    return x, Q, K, V, Z, A, A @ V


def picture(*tensors):
    fig, ax = plt.subplots(figsize=(10.0, 4.6))
    dataflow(*tensors, token_labels=SIX_WORDS, ax=ax)
    return png_bytes(fig)


def test_the_same_tensors_give_the_same_picture():
    assert picture(*layer()) == picture(*layer())


def test_every_matrix_is_drawn_with_its_shape():
    fig, ax = plt.subplots()
    dataflow(*layer(), ax=ax)
    texts = " ".join(t.get_text() for t in ax.texts)
    plt.close(fig)
    assert len(ax.images) == 7  # X, Q, K, V, Z, A, output
    for shape in ("[6, 3]", "[6, 2]", "[6, 4]", "[6, 6]"):
        assert shape in texts


def test_shapes_that_do_not_fit_eq_2_2_are_refused():
    x, Q, K, V, Z, A, out = layer()
    with pytest.raises(ValueError, match="d_k"):
        dataflow(x, Q, K[:, :1], V, Z, A, out)
    with pytest.raises(ValueError, match="output"):
        dataflow(x, Q, K, V, Z, A, out[:, :3])
