"""The transpose-trap picture's data: split_heads keeps heads whole, a bare reshape mixes them."""

import torch

import attnlib
from attnlib.figures.memory_layout import origins, plot_transpose_trap, splits


def test_the_right_split_is_split_heads_and_gives_each_head_its_own_features():
    right, wrong = splits(6, 3, 4)
    memory = origins(6, 3, 4)
    for channel in range(2):
        assert torch.equal(
            right[..., channel], attnlib.split_heads(memory[None, ..., channel], 3)[0]
        )
    for h in range(3):
        assert (right[h, ..., 1] == h).all()  # every number of head h belongs to head h
        assert torch.equal(right[h, :, 0, 0], torch.arange(6))  # one row per token


def test_the_bare_reshape_mixes_heads_and_tokens():
    _, wrong = splits(6, 3, 4)
    assert wrong.shape == (3, 6, 4, 2)
    assert set(wrong[0, ..., 1].flatten().tolist()) == {0, 1, 2}  # 'head 0' holds all heads
    assert set(wrong[0, ..., 0].flatten().tolist()) == {0, 1}  # ... of tokens 0 and 1 only


def test_the_picture_draws_one_cell_per_number():
    ax = plot_transpose_trap(6, 3, 4)
    assert len(ax.patches) == 3 * 6 * 12  # the memory, and two splits of it
    ax.figure.clf()
