"""The checked exercises that parts V and VI gained: 19.1's line-start score and 22.4's ring step.

19.1 (`line_start_score`) is an ordinary exercise. 22.4 (`ring_step`) runs the reader's function
in two gloo processes through `on_two_processes`, which sends the function by value (a notebook
is no module a started process could import it from). Here: the planted wrong answers are named,
correct answers in several styles pass, and the ring step's failures (an error in one process, a
receive nothing answers, a closure) come back as one line. `PLANTED` and `CORRECT` have the shape
of tests/test_exercises.py's tables, so they can join them.
"""

import math

import pytest
import torch
import torch.distributed as dist

from attnlib import causal_attention, merge_attention, tiled_attention
from attnlib.lab.exercises import BUGS, EXERCISES, check
from attnlib.lab.exercises.ch22 import on_two_processes, run_step
from tests.test_exercises import correct_answers_test, named_bug_test

# ---- 19.1: the weight on the start of the line -------------------------------------------


def line_start_loop(weights, newline):
    """Query by query, as the definition reads."""
    b, h, t, _ = weights.shape
    total, count = torch.zeros(h, dtype=torch.float64), 0
    for row in range(b):
        for i in range(t):
            before = [j for j in range(i) if newline[row, j]]
            if before and before[-1] < i - 1:
                total += weights[row, :, i, before[-1]].double()
                count += 1
    return total / count


def line_start_mask(weights, newline):
    """One boolean [B, T, T] of (query, key = its line's start) pairs."""
    t = newline.shape[-1]
    earlier = torch.ones(t, t, dtype=torch.bool).tril(-1)  # key j < query i
    breaks = newline[:, None, :] & earlier  # [B, T, T]
    index = torch.arange(t).expand_as(breaks)
    start = torch.where(breaks, index, -1).amax(-1)  # [B, T]
    counted = (start >= 0) & (start < torch.arange(t) - 1)
    pairs = (index == start[..., None]) & counted[..., None]  # [B, T, T]
    return (weights * pairs[:, None]).sum((0, 2, 3)) / counted.sum()


def line_start_with_previous(weights, newline):
    """Keeps the queries right after a break."""
    b, h, t, _ = weights.shape
    total, count = torch.zeros(h, dtype=torch.float64), 0
    for row in range(b):
        for i in range(t):
            before = [j for j in range(i) if newline[row, j]]
            if before:
                total += weights[row, :, i, before[-1]].double()
                count += 1
    return total / count


def line_start_all_queries(weights, newline):
    """Divides by every query of every window."""
    counted = line_start_loop(weights, newline)
    b, t = newline.shape
    kept = sum(
        1
        for row in range(b)
        for i in range(t)
        if any(newline[row, :i]) and max(j for j in range(i) if newline[row, j]) < i - 1
    )
    return counted * kept / (b * t)


# ---- 22.4: one step of the ring, in two processes ----------------------------------------


def ring_step(q, k, v, rank, world):
    """The answer of the book: one message, both transfers posted together."""
    n, dim = q.shape[2], k.shape[-1]
    kv = torch.cat([k, v], dim=-1)
    incoming = torch.empty_like(kv)
    requests = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, kv, (rank + 1) % world),
            dist.P2POp(dist.irecv, incoming, (rank - 1) % world),
        ]
    )
    for request in requests:
        request.wait()
    source = (rank - 1) % world
    mine, theirs = positions_of(rank, n), positions_of(source, n)
    return tiled_attention(
        q, incoming[..., :dim], incoming[..., dim:], mine, theirs, return_lse=True
    )


def positions_of(rank, n):  # a helper of the reader's, sent along by value
    return torch.arange(rank * n, rank * n + n)


def ring_step_two_messages(q, k, v, rank, world):
    """K and V as two messages, the even rank sending first: plain send and recv."""
    k_in, v_in = torch.empty_like(k), torch.empty_like(v)
    for tensor, into in ((k, k_in), (v, v_in)):
        if rank % 2 == 0:
            dist.send(tensor, (rank + 1) % world)
            dist.recv(into, (rank - 1) % world)
        else:
            dist.recv(into, (rank - 1) % world)
            dist.send(tensor, (rank + 1) % world)
    n = q.shape[2]
    scores = q @ k_in.transpose(-2, -1) / math.sqrt(q.shape[-1])
    source = (rank - 1) % world
    hidden = positions_of(source, n)[None, :] > positions_of(rank, n)[:, None]
    scores = scores.masked_fill(hidden, -math.inf)
    lse = scores.logsumexp(-1)
    weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return weights @ v_in, lse


def own_shard(q, k, v, rank, world):
    n = q.shape[2]
    return tiled_attention(q, k, v, positions_of(rank, n), positions_of(rank, n), return_lse=True)


def exchanged(k, v, rank, world):
    kv, incoming = torch.cat([k, v], -1), torch.empty(k.shape[:-1] + (2 * k.shape[-1],))
    for request in dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, kv, (rank + 1) % world),
            dist.P2POp(dist.irecv, incoming, (rank - 1) % world),
        ]
    ):
        request.wait()
    return incoming.chunk(2, -1)


def local_positions(q, k, v, rank, world):
    k_in, v_in = exchanged(k, v, rank, world)
    return tiled_attention(q, k_in, v_in, return_lse=True)  # positions 0 .. n-1 on both


def softmax_nan(q, k, v, rank, world):
    k_in, v_in = exchanged(k, v, rank, world)
    n, source = q.shape[2], (rank - 1) % world
    scores = q @ k_in.transpose(-2, -1) / math.sqrt(q.shape[-1])
    hidden = positions_of(source, n)[None, :] > positions_of(rank, n)[:, None]
    scores = scores.masked_fill(hidden, -math.inf)
    return torch.softmax(scores, -1) @ v_in, scores.logsumexp(-1)


PLANTED = {  # bug -> (exercise, the reader's wrong answer), as in tests/test_exercises.py
    "line_start_after_break": ("line_start_score", line_start_with_previous),
    "line_start_over_all_queries": ("line_start_score", line_start_all_queries),
    "ring_step_own_shard": ("ring_step", on_two_processes(own_shard)),
    "ring_step_local_positions": ("ring_step", on_two_processes(local_positions)),
}
PLANTED_ALSO = [("ring_empty_shard_nan", "ring_step", on_two_processes(softmax_nan))]
CORRECT = {
    "line_start_score": [line_start_loop, line_start_mask],
    "ring_step": [on_two_processes(ring_step), on_two_processes(ring_step_two_messages)],
}
PAIRS = [(bug, ex, fn) for bug, (ex, fn) in PLANTED.items()] + PLANTED_ALSO


def test_the_new_bugs_are_all_planted():
    mine = {bug for name in CORRECT for bug in EXERCISES[name].bugs}
    assert mine == {bug for bug, _, _ in PAIRS}
    assert set(PLANTED) <= set(BUGS)


def test_the_ring_step_equals_one_process_on_other_shapes():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 10, 6, generator=gen) for _ in range(3))
    out, lse = run_step(ring_step, q, k, v)
    want_out, want_lse = EXERCISES["ring_step"].reference(q, k, v)
    assert torch.allclose(out.double(), want_out, atol=1e-5)
    assert torch.equal(lse[:, :, :5], torch.full((2, 3, 5), -math.inf))  # shard 1: the future
    assert torch.allclose(lse[:, :, 5:].double(), want_lse[:, :, 5:], atol=1e-5)
    # step 0 (each its own shard) merged with step 1 is causal attention over all 10 positions
    both, _ = merge_attention(*run_step(own_shard, q, k, v), out, lse)
    assert torch.allclose(both, causal_attention(q, k, v), atol=1e-5)


# ---- what the reader sees when the processes go wrong ------------------------------------


def raises_in_one(q, k, v, rank, world):
    if rank == 1:
        q = q @ k.double()  # a dtype mismatch, in process 1 only
    dist.recv(torch.empty(3), 1 - rank)
    return q, q


def waits_for_ever(q, k, v, rank, world):
    dist.recv(torch.empty(3), 1 - rank)  # both receive, nobody sends
    return q, q


def stub(q, k, v, rank, world):
    raise NotImplementedError


def test_a_failing_process_is_named_with_the_readers_line(capsys):
    result = check("ring_step", on_two_processes(raises_in_one))
    assert not result.passed
    line = raises_in_one.__code__.co_firstlineno + 2
    words = f"RuntimeError: in process 1 at line {line}, `q = q @ k.double()"
    assert words in result.message, result.message
    assert "Traceback" not in capsys.readouterr().out


def test_a_stub_says_not_implemented_and_lists_the_cases():
    result = check("ring_step", on_two_processes(stub))
    assert "Not implemented yet" in result.message
    assert "Cases it will run: B=1, H=2, T=8, D=4, 2 processes" in " ".join(result.text.split())


def test_a_receive_nothing_answers_times_out_and_leaves_no_process():
    import multiprocessing

    q = torch.zeros(1, 1, 4, 2)
    with pytest.raises(TimeoutError, match="did not finish in 3 s"):
        run_step(waits_for_ever, q, q, q, timeout=3)
    assert not multiprocessing.active_children()


def test_a_closure_gets_words_not_a_pickling_error():
    offset = 1

    def closure(q, k, v, rank, world):
        return q + offset, q

    result = check("ring_step", on_two_processes(closure))
    assert "define it at the top level of a cell" in result.message, result.message


def test_globals_travel_by_value():
    namespace = {"torch": torch, "dist": dist, "scale": torch.tensor(2.0)}
    exec(
        "def doubled(q, k, v, rank, world):\n    return q * scale, q.sum(-1) * 0\n",
        namespace,
    )
    q = torch.randn(1, 1, 4, 2)
    out, _ = run_step(namespace["doubled"], q, q, q)
    assert torch.equal(out, 2 * q)


test_each_planted_bug_is_named = named_bug_test(PAIRS)
test_correct_answers_pass = correct_answers_test(CORRECT)
