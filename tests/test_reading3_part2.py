"""The figures and layout facts of chapters 6-9, against independent references.

The mask figure of chapter 7 against a brute-force reading of eq. 7.1; the head groups of
chapter 9 against eq. 9.1 written out; the row permutation of Hugging Face's Llama conversion
script against chapter 8's Pi, and rotate half against interleaved pairs through it.
"""

import math

import pytest
import torch

from attnlib.figures.head_groups import kv_heads_read, plot_head_groups
from attnlib.figures.position_masks import mask_panels, plot_position_masks


def brute_mask(query_positions, key_positions, window=None):
    """Eq. 7.1 by loops; a key with a negative position is a pad and hidden; `window` keeps keys
    fewer than `window` positions back."""
    rows = []
    for pos_q in query_positions.tolist():
        row = []
        for pos_k in key_positions.tolist():
            seen = 0 <= pos_k <= pos_q
            if window is not None:
                seen = seen and pos_q - pos_k < window
            row.append(seen)
        rows.append(row)
    return torch.tensor(rows)


def test_the_mask_figure_draws_eq_7_1_with_pads_and_a_window():
    panels = mask_panels()
    assert len(panels) == 4
    windows = [None, None, None, 3]
    for (title, query_positions, key_positions, mask), window in zip(panels, windows):
        assert mask.dtype == torch.bool
        assert torch.equal(mask, brute_mask(query_positions, key_positions, window)), title
    _, pad_queries, _, pad_mask = panels[2]
    assert pad_queries.tolist() == [-2, -1, 0, 1, 2, 3]
    assert not pad_mask[:2].any() and not pad_mask[:, :2].any()  # pads read and give nothing
    _, chunk_queries, _, chunk_mask = panels[1]
    assert chunk_queries.tolist() == [3, 4, 5] and chunk_mask.sum().item() == 4 + 5 + 6


def test_the_mask_figure_has_one_panel_per_case():
    fig = plot_position_masks()
    assert len(fig.axes) == 4
    assert all(len(ax.images) == 1 for ax in fig.axes)
    fig.clf()


SETTINGS = [(16, 16), (16, 8), (16, 4), (16, 2), (16, 1), (6, 3)]


@pytest.mark.parametrize("q_heads, kv_heads", SETTINGS)
def test_the_head_groups_are_eq_9_1(q_heads, kv_heads):
    group = q_heads // kv_heads
    assert kv_heads_read(q_heads, kv_heads) == [h // group for h in range(q_heads)]


def test_qwen3_query_head_11_reads_kv_head_5_and_the_figure_draws_every_link():
    assert kv_heads_read(16, 8)[11] == 5
    fig = plot_head_groups(16, (16, 8, 4, 2, 1))
    ax = fig.axes[0]
    assert len(ax.lines) == 5 * 16  # one link per query head in each row
    assert len(ax.patches) == 5 * 16 + (16 + 8 + 4 + 2 + 1)  # query and KV head boxes
    fig.clf()


def hf_permute(w, n_heads, dim1, dim2):
    """transformers' src/transformers/models/llama/convert_llama_weights_to_hf.py, `permute`."""
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def rotate_interleaved(x, p, theta):
    """Pairs (2m, 2m+1) turned by p * theta_m, written as 2x2 rotations, one pair at a time."""
    out = x.clone()
    for m, angle in enumerate((p * theta).tolist()):
        c, s = math.cos(angle), math.sin(angle)
        a, b = x[..., 2 * m], x[..., 2 * m + 1]
        out[..., 2 * m], out[..., 2 * m + 1] = c * a - s * b, s * a + c * b
    return out


def rotate_half_form(x, p, theta):
    """Pairs (m, m + D/2) turned by p * theta_m: x cos + rotate_half(x) sin."""
    half = x.shape[-1] // 2
    angles = p * torch.cat((theta, theta))
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * angles.cos() + turned * angles.sin()


def test_the_llama_conversion_permutes_each_head_by_pi_and_keeps_the_scores():
    gen = torch.Generator().manual_seed(8)
    heads, D, d_model = 3, 8, 12
    pi = list(range(0, D, 2)) + list(range(1, D, 2))  # 2m -> m, 2m+1 -> m + D/2
    w_meta = torch.randn(heads * D, d_model, generator=gen, dtype=torch.float64)
    w_hf = hf_permute(w_meta, heads, heads * D, d_model)
    assert torch.equal(w_hf, w_meta.view(heads, D, d_model)[:, pi].reshape(heads * D, d_model))
    theta = 10000.0 ** (-torch.arange(D // 2, dtype=torch.float64) * 2 / D)
    x_q, x_k = torch.randn(2, d_model, generator=gen, dtype=torch.float64)
    for i, j in [(0, 0), (5, 2), (40, 47)]:
        meta = [
            rotate_interleaved((x_q @ w_meta.T).view(heads, D), i, theta),
            rotate_interleaved((x_k @ w_meta.T).view(heads, D), j, theta),
        ]
        hf = [
            rotate_half_form((x_q @ w_hf.T).view(heads, D), i, theta),
            rotate_half_form((x_k @ w_hf.T).view(heads, D), j, theta),
        ]
        scores_meta = (meta[0] * meta[1]).sum(-1)  # one score per head
        scores_hf = (hf[0] * hf[1]).sum(-1)
        assert torch.allclose(scores_meta, scores_hf, atol=1e-12, rtol=0)
