"""Chapter 24's checked exercise, `alibi_slopes` (24.1): ALiBi's slopes for any head count.

`PLANTED` (bug -> (exercise, the reader's wrong answer)) and `CORRECT` have the shape of
tests/test_exercises.py's tables, so they can join them. The answers are written as a reader
would, apart from the module's reference; one is BLOOM's own function.
"""

import math

import torch

from attnlib.lab.exercises import BUGS, EXERCISES, check
from tests.test_exercises import assert_bugs_differ, correct_answers_test, named_bug_test


def slopes_loop(heads):
    power = 1
    while power * 2 <= heads:
        power *= 2
    out = [2 ** (-8 * (h + 1) / power) for h in range(power)]
    extra = [2 ** (-8 * (h + 1) / (2 * power)) for h in range(0, 2 * power, 2)]
    return torch.tensor(out + extra[: heads - power])


def slopes_ratio(heads):
    """The paper's phrasing: a geometric sequence that starts at, and has the ratio, 2**(-8/n)."""

    def geometric(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    n = 2 ** math.floor(math.log2(heads))
    return torch.tensor(geometric(n) + geometric(2 * n)[0::2][: heads - n], dtype=torch.float64)


def slopes_bloom(heads):
    from attnlib.lab.long_context import bloom_slopes

    return bloom_slopes(heads)


def next_power(heads):
    n = 2 ** math.ceil(math.log2(heads))
    return torch.tensor([2 ** (-8 * h / n) for h in range(1, heads + 1)])


def formula_for_any_h(heads):
    return torch.tensor([2 ** (-8 * h / heads) for h in range(1, heads + 1)])


def from_zero(heads):
    return slopes_loop(heads) * torch.tensor(
        [2 ** (8 / (2 ** math.floor(math.log2(heads))))] * (2 ** math.floor(math.log2(heads)))
        + [2 ** (8 / (2 ** (math.floor(math.log2(heads)) + 1)))]
        * (heads - 2 ** math.floor(math.log2(heads)))
    )


PLANTED = {
    "alibi_next_power": ("alibi_slopes", next_power),
    "alibi_formula_for_any_h": ("alibi_slopes", formula_for_any_h),
    "alibi_from_zero": ("alibi_slopes", from_zero),
}
CORRECT = {"alibi_slopes": [slopes_loop, slopes_ratio, slopes_bloom]}
PAIRS = [(bug, ex, fn) for bug, (ex, fn) in PLANTED.items()]


def test_the_new_bugs_are_all_planted():
    assert set(EXERCISES["alibi_slopes"].bugs) == set(PLANTED)
    assert set(PLANTED) <= set(BUGS)
    assert_bugs_differ("alibi_slopes", PLANTED)


def test_the_reference_is_attnlibs():
    from attnlib.alibi import alibi_slopes

    for heads in range(1, 70):
        want = EXERCISES["alibi_slopes"].reference(heads)
        torch.testing.assert_close(alibi_slopes(heads).double(), want, rtol=1e-7, atol=0)


def test_a_stub_says_not_yet():
    def stub(heads):
        raise NotImplementedError

    result = check("alibi_slopes", stub)
    assert not result.passed and "Not implemented yet" in result.message


test_each_planted_bug_is_named = named_bug_test(PAIRS)
test_correct_answers_pass = correct_answers_test(CORRECT)
