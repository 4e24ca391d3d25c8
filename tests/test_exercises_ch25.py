"""Exercise 25.1 (`gated_delta_step`): the planted wrong answers are named, correct answers in
several styles pass. `PLANTED` and `CORRECT` have the shape of tests/test_exercises.py's tables.
"""

import torch

from attnlib.delta_rule import gated_delta_rule_recurrent
from attnlib.lab.exercises import BUGS, EXERCISES
from tests.test_exercises import assert_bugs_differ, correct_answers_test, named_bug_test


def step_einsum(state, k, v, alpha, eta):
    decayed = alpha[..., None, None] * state
    read = torch.einsum("bhd,bhde->bhe", k, decayed)
    return decayed + torch.einsum("bhd,bhe->bhde", k, eta[..., None] * (v - read))


def step_matrices(state, k, v, alpha, eta):
    """As eq. (25.9) reads with matrices: alpha (I - eta k^T k) Omega + eta k^T v."""
    d = k.shape[-1]
    outer = k[..., :, None] * k[..., None, :]  # k^T k, [B, H, D, D]
    forget = torch.eye(d) - eta[..., None, None] * outer
    return (
        alpha[..., None, None] * forget @ state
        + eta[..., None, None] * k[..., :, None] * v[..., None, :]
    )


def step_decay_after(state, k, v, alpha, eta):
    read = torch.einsum("bhd,bhde->bhe", k, state)
    written = state + torch.einsum("bhd,bhe->bhde", k, eta[..., None] * (v - read))
    return alpha[..., None, None] * written


def step_read_old(state, k, v, alpha, eta):
    read = torch.einsum("bhd,bhde->bhe", k, state)  # before the decay
    decayed = alpha[..., None, None] * state
    return decayed + torch.einsum("bhd,bhe->bhde", k, eta[..., None] * (v - read))


def step_additive(state, k, v, alpha, eta):
    return alpha[..., None, None] * state + torch.einsum("bhd,bhe->bhde", k, eta[..., None] * v)


PLANTED = {  # bug -> (exercise, the reader's wrong answer), as in tests/test_exercises.py
    "delta_decay_after_write": ("gated_delta_step", step_decay_after),
    "delta_read_before_decay": ("gated_delta_step", step_read_old),
    "delta_additive_write": ("gated_delta_step", step_additive),
}
CORRECT = {"gated_delta_step": [step_einsum, step_matrices]}
PAIRS = [(bug, ex, fn) for bug, (ex, fn) in PLANTED.items()]


def test_the_new_bugs_are_all_planted():
    mine = {bug for name in CORRECT for bug in EXERCISES[name].bugs}
    assert mine == set(PLANTED) and set(PLANTED) <= set(BUGS)
    assert_bugs_differ("gated_delta_step", PLANTED)


def test_the_reference_is_one_step_of_the_library_recurrence():
    ex = EXERCISES["gated_delta_step"]
    for case in ex.cases():
        state, k, v, alpha, eta = (x.double() for x in case.args)
        q = torch.zeros_like(k)[:, :, None]
        _, want = gated_delta_rule_recurrent(
            q, k[:, :, None], v[:, :, None], alpha[..., None], eta[..., None], initial_state=state
        )
        assert torch.allclose(ex.reference(*case.args), want, atol=1e-12, rtol=0)


test_each_planted_bug_is_named = named_bug_test(PAIRS)
test_correct_answers_pass = correct_answers_test(CORRECT)
