"""Split-KV decoding (flash-decoding): the cache cut into chunks, each attended alone, merged.

Each chunk gives a partial output and its log-sum-exp lse (`tiled_attention(..., return_lse=True)`);
`merge_attention` (eq. 21.1) folds the partials into the exact answer. The chunks are
independent, so they can run at once: here on threads, each running one torch thread.
"""

import textwrap
from concurrent.futures import ThreadPoolExecutor

import torch

from attnlib import merge_attention, tiled_attention


def chunk_bounds(keys: int, chunk: int) -> list:
    """[(start, stop), ...] cutting 0..keys-1 into runs of `chunk` keys (the last may be short)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an integer of at least 1, got {chunk!r}")
    return [(start, min(start + chunk, keys)) for start in range(0, keys, chunk)]


def _positions(positions, batch, length, start, device):
    if positions is None:
        return torch.arange(start, start + length, device=device).expand(batch, length)
    positions = torch.as_tensor(positions, device=device)
    return positions.expand(batch, length) if positions.dim() == 1 else positions


def chunk_partials(q, k, v, chunk, query_positions=None, key_positions=None, scale=None, pool=None):
    """One (out [B, Hq, T, Dv], lse [B, Hq, T]) partial per chunk of keys of k [B, Hkv, S, D].

    Positions as in `causal_attention` (default: the queries are the last T of the S keys).
    `pool`: a `concurrent.futures` executor to run the chunks on, or None (one after another).
    """
    batch, keys = q.shape[0], k.shape[2]
    query_positions = _positions(query_positions, batch, q.shape[2], keys - q.shape[2], q.device)
    key_positions = _positions(key_positions, batch, keys, 0, q.device)

    def part(bounds):
        start, stop = bounds
        return tiled_attention(
            q,
            k[:, :, start:stop],
            v[:, :, start:stop],
            query_positions=query_positions,
            key_positions=key_positions[:, start:stop],
            scale=scale,
            block_size=stop - start,  # one tile per chunk: the chunk is the unit of work
            return_lse=True,
        )

    bounds = chunk_bounds(keys, chunk)
    return list(pool.map(part, bounds)) if pool is not None else [part(b) for b in bounds]


def merge_all(partials):
    """Fold a list of (out, lse) partials with eq. 21.1, left to right; returns (out, lse)."""
    if not partials:
        raise ValueError("no partials to merge")
    out, lse = partials[0]
    for other_out, other_lse in partials[1:]:
        out, lse = merge_attention(out, lse, other_out, other_lse)
    return out, lse


def split_kv_attention(
    q, k, v, chunk, query_positions=None, key_positions=None, scale=None, workers=1
):
    """`causal_attention` computed chunk by chunk over the keys and merged (eq. 21.1).

    q [B, Hq, T, D] (a decode step has T = 1), k [B, Hkv, S, D], v [B, Hkv, S, Dv]
    -> [B, Hq, T, Dv] in q's dtype. workers > 1 runs the chunks on that many threads.
    """
    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            partials = chunk_partials(q, k, v, chunk, query_positions, key_positions, scale, pool)
    else:
        partials = chunk_partials(q, k, v, chunk, query_positions, key_positions, scale)
    out, _ = merge_all(partials)
    return out.to(q.dtype)


def decode_timings(keys=32768, dim=64, chunks=(32768, 8192, 2048), workers=(1, 2), repeats=5):
    """Median seconds of one decode query (1 head) against `keys` keys, per chunk and workers.

    Returns {(chunk, workers): seconds}; the chunk equal to `keys` is the unsplit call. The
    calls are timed interleaved, so a busy neighbour slows them all alike.
    """
    from .timing import interleaved_medians

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, dim, generator=gen)
    k, v = (torch.randn(1, 1, keys, dim, generator=gen) for _ in range(2))
    pools = {n: ThreadPoolExecutor(n) for n in workers if n > 1}
    try:
        calls = {}
        for chunk in chunks:
            for n in workers:
                pool = pools.get(n)
                calls[(chunk, n)] = lambda c=chunk, p=pool: merge_all(
                    chunk_partials(q, k, v, c, pool=p)
                )
        return interleaved_medians(calls, repeats)
    finally:
        for pool in pools.values():
            pool.shutdown()


def thread_control(size=512, repeats=5) -> dict:
    """A control for `decode_timings`: two compute-bound matmuls one after the other against
    the same two on two threads (median seconds). No gain here means no idle core to use."""
    from .timing import interleaved_medians

    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=gen) for _ in range(2))
    with ThreadPoolExecutor(2) as pool:
        return interleaved_medians(
            {
                "one thread": lambda: [a @ a, b @ b],
                "two threads": lambda: list(pool.map(lambda x: x @ x, (a, b))),
            },
            repeats,
        )


def read_control(timings, control, free_core=1.3) -> str:
    """What this run's timings can say, read from the control (`thread_control`).

    timings: {keys: `decode_timings` result}. Two threads must run the control's matmuls at
    least `free_core` times faster than one before a second core counts as free; otherwise
    the one- and two-worker times differ by noise alone and the reading says so. With a free
    core it reports, per cache length, the best split's time over the unsplit one-thread time.
    """
    one, two = control["one thread"], control["two threads"]
    speedup = one / two
    head = f"control: {one * 1e3:.2f} ms on one thread, {two * 1e3:.2f} ms on two, {speedup:.2f}x"
    if not speedup >= free_core:  # also true for a NaN
        lines = [
            f"{head}: no second core was free, so the one- and two-worker times differ by "
            "noise alone and say nothing about splitting across cores."
        ]
    else:
        lines = [f"{head}: a second core was free."]
        for keys, times in timings.items():
            unsplit = times[(keys, 1)]
            split = {c: s for (c, w), s in times.items() if c < keys and w > 1}
            chunk = min(split, key=split.get)
            lines.append(
                f"{keys} keys: the best split (chunks of {chunk}, two workers) took "
                f"{split[chunk] / unsplit:.2f} of the unsplit call's time."
            )
    return "\n".join(textwrap.fill(line, 78, subsequent_indent="  ") for line in lines)
