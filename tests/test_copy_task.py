"""The copy task of chapter 5: without the mask the model copies the next token."""

import math

import torch

from attnlib.lab import copy_task


def test_without_the_mask_the_model_copies_and_with_it_stays_at_ln_vocab():
    setup = copy_task.Setup()
    unmasked, masked = copy_task.train(False), copy_task.train(True)
    assert unmasked.loss < 0.1 < math.log(setup.vocab) - 0.05 < masked.loss
    ahead = unmasked.weights.diagonal(offset=1)  # weight of query i on key i + 1
    assert ahead.min() > 0.9
    assert torch.equal(masked.weights.triu(1), torch.zeros(setup.length, setup.length))
    for result in (unmasked, masked):
        assert torch.allclose(result.weights.sum(-1), torch.ones(setup.length))


def test_training_is_seeded():
    assert copy_task.train(False, copy_task.Setup(steps=5)).loss == (
        copy_task.train(False, copy_task.Setup(steps=5)).loss
    )


def test_recording_snapshots_changes_nothing_in_the_training():
    setup = copy_task.Setup(steps=5)
    plain = copy_task.train(False, setup)
    recorded = copy_task.train(False, setup, snapshot_steps=(0, 2, 5))
    assert plain.loss == recorded.loss and torch.equal(plain.weights, recorded.weights)
    assert sorted(recorded.snapshots) == [0, 2, 5] and plain.snapshots == {}
