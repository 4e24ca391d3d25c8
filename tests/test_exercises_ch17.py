"""Chapter 17's checked exercise, `triton_tiles` (17.1): the tiles a causal program visits.

`PLANTED` (bug -> (exercise, the reader's wrong answer)) and `CORRECT` have the shape of
tests/test_exercises.py's tables, so they can join them. The answers are written as a reader
would, independently of the module's reference; one correct answer counts the tiles from the
Triton module's own `key_block_ends`, and one from every (query, key) pair.
"""

import torch

from attnlib.lab.exercises import BUGS, EXERCISES, check
from tests.test_exercises import assert_bugs_differ, correct_answers_test, named_bug_test

try:  # at collection, before any torch.compile imports triton without its interpreter
    import attnlib.lab.triton_attention as ta
except ImportError:  # no triton installed
    ta = None


def tiles_loop(queries, keys, block):
    """Per query block, one past its largest position, in blocks, rounded up."""
    total = 0
    for start in range(0, queries, block):
        largest = keys - queries + min(start + block, queries) - 1
        total += largest // block + 1
    return total


def tiles_from_pairs(queries, keys, block):
    """Every (query, key) pair the rule shows; a tile is visited up to its row's last key."""
    query_pos = torch.arange(keys - queries, keys)
    seen = torch.arange(keys)[None, :] <= query_pos[:, None]  # [T, S], eq. 7.1
    total = 0
    for start in range(0, queries, block):
        last = int(seen[start : start + block].any(0).nonzero().max())
        total += last // block + 1
    return torch.tensor(total)


def tiles_from_the_kernel_module(queries, keys, block):
    ends = ta.key_block_ends(
        torch.arange(keys - queries, keys)[None], torch.arange(keys)[None], block
    )
    return float((-(-ends // block)).sum())


def diagonal_skipped(queries, keys, block):
    """Only the key blocks wholly before the block's first query."""
    total = 0
    for start in range(0, queries, block):
        total += (keys - queries + start + 1) // block
    return total


def offset_ignored(queries, keys, block):
    total = 0
    for start in range(0, queries, block):
        total += (min(start + block, queries) - 1) // block + 1
    return total


def end_off_by_one(queries, keys, block):
    total = 0
    for start in range(0, queries, block):
        end = keys - queries + min(start + block, queries) - 1  # the largest, not one past it
        total += -(-end // block)
    return total


PLANTED = {
    "triton_diagonal_skipped": ("triton_tiles", diagonal_skipped),
    "triton_offset_ignored": ("triton_tiles", offset_ignored),
    "triton_end_off_by_one": ("triton_tiles", end_off_by_one),
}
CORRECT = {"triton_tiles": [tiles_loop, tiles_from_pairs]}
if ta is not None:
    CORRECT["triton_tiles"].append(tiles_from_the_kernel_module)
PAIRS = [(bug, ex, fn) for bug, (ex, fn) in PLANTED.items()]


def test_the_new_bugs_are_all_planted():
    assert {bug for bug in EXERCISES["triton_tiles"].bugs} == set(PLANTED)
    assert set(PLANTED) <= set(BUGS)
    assert_bugs_differ("triton_tiles", PLANTED)


def test_a_stub_says_not_yet():
    def stub(queries, keys, block):
        raise NotImplementedError

    result = check("triton_tiles", stub)
    assert not result.passed and "Not implemented yet" in result.message


test_each_planted_bug_is_named = named_bug_test(PAIRS)
test_correct_answers_pass = correct_answers_test(CORRECT)
