"""Ring attention over torch.distributed: each process holds a shard of the sequence.

Process r keeps its queries and passes its keys and values around a ring: at step s it holds
the K/V shard of process (r - s) mod P, attends to it with `tiled_attention(...,
return_lse=True)` and folds the partial into its running answer with `merge_attention`
(eq. 21.1), while the next shard is already on its way (`batch_isend_irecv`). After P steps
every query has seen every key. Each process counts the tiles it computes with a counter of
the matrix products torch runs (`TileCounter`); `schedule` enumerates the visible pairs
instead, one by one, so the two counts are independent. The workers live here, importable,
so that `torch.multiprocessing` can start them from a notebook; every run stops its
processes, also when one fails or the run outlasts its timeout.
"""

import logging
import multiprocessing
import os
import socket
import tempfile
import time
from datetime import timedelta
from functools import partial
from typing import List, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException
from torch.utils._python_dispatch import TorchDispatchMode

from attnlib import merge_attention, tiled_attention

ORDERS = ("contiguous", "zigzag", "striped")
SPAWN_LOG = logging.getLogger("torch.multiprocessing.spawn")
_PRODUCTS = {torch.ops.aten.bmm, torch.ops.aten.mm, torch.ops.aten.baddbmm, torch.ops.aten.addmm}


def shard_runs(order: str, rank: int, world: int, length: int) -> list:
    """The runs [(start, stop), ...] of positions process `rank` holds, in the order it holds them.

    contiguous: one run of length / P. zigzag: chunk r and chunk 2P-1-r of 2P equal chunks,
    so each process holds one early and one late piece of the sequence. striped: every P-th
    position from r on, runs of one position.
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    pieces = {"contiguous": world, "zigzag": 2 * world, "striped": world}[order]
    if length % pieces:
        raise ValueError(f"{order} shards need the length ({length}) divisible by {pieces}")
    if order == "striped":
        return [(p, p + 1) for p in range(rank, length, world)]
    size = length // pieces
    chunks = [rank] if order == "contiguous" else [rank, 2 * world - 1 - rank]
    return [(c * size, (c + 1) * size) for c in chunks]


def shard_positions(order: str, rank: int, world: int, length: int) -> torch.Tensor:
    """The positions process `rank` holds, in its order, as a long tensor [length / P]."""
    runs = shard_runs(order, rank, world, length)
    return torch.cat([torch.arange(start, stop) for start, stop in runs])


def _cut(positions, tile: int) -> list:
    positions = [int(p) for p in positions]
    return [positions[i : i + tile] for i in range(0, len(positions), tile)]


def tiles_computed(query_positions, key_positions, tile: int, causal: bool = True) -> int:
    """Tiles of tile x tile (query, key) pairs, cut in the order a process holds its positions,
    that hold at least one visible pair (eq. 7.1), found pair by pair with no tensors.

    For contiguous shards of n tiles this is eq. 22.2: r n^2 + n(n + 1)/2 over a whole ring.
    """
    query_tiles, key_tiles = _cut(query_positions, tile), _cut(key_positions, tile)
    if not causal:
        return len(query_tiles) * len(key_tiles)
    return sum(
        1
        for queries in query_tiles
        for keys in key_tiles
        if any(key <= query for query in queries for key in keys)
    )


def pairs_visible(query_positions, key_positions) -> int:
    """(query, key) pairs that the positions rule (eq. 7.1) shows, counted one by one."""
    keys = [int(k) for k in key_positions]
    return sum(1 for query in query_positions for key in keys if key <= int(query))


def schedule(world: int, length: int, order: str, tile: int, causal: bool = True) -> list:
    """For each step, for each process: (the shard it holds, its tiles with a pair that eq. 7.1
    shows), found pair by pair; summed over the steps, eq. 22.2 for contiguous shards."""
    held = [shard_positions(order, r, world, length) for r in range(world)]
    return [
        [
            ((r - step) % world, tiles_computed(held[r], held[(r - step) % world], tile, causal))
            for r in range(world)
        ]
        for step in range(world)
    ]


def bytes_sent_formula(world, batch, kv_heads, length, head_dim, value_dim, element_size=4):
    """Bytes one process sends: P-1 shards of K and V, each [B, Hkv, T/P, D] (eq. 22.3)."""
    return (
        (world - 1) * batch * kv_heads * (length // world) * (head_dim + value_dim) * element_size
    )


class TileCounter(TorchDispatchMode):
    """Counts the matrix products torch runs inside `with TileCounter() as counter:`.

    Each tile `tiled_attention` computes is two of them, its scores and its weighted sum of
    the values (eqs. 14.1-14.2), so `counter.tiles` is the tiles computed; a skipped tile
    runs none.
    """

    def __init__(self):
        super().__init__()
        self.products = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in _PRODUCTS:
            self.products += 1
        return func(*args, **(kwargs or {}))

    @property
    def tiles(self) -> int:
        return self.products // 2


def ring_loop(rank, world, q, kv, queries_at, keys_at, tile):
    """Eq. 22.1 for process `rank`: q [B, Hq, n, D] stays; kv [B, Hkv, n, D+Dv]
    moves; keys_at[s]: shard s's positions. -> out, lse, tiles a step, bytes"""
    attend = partial(tiled_attention, block_size=tile, return_lse=True)
    dim, out, lse, tiles, sent = q.shape[-1], None, None, [], 0
    for step in range(world):
        last = step == world - 1
        if not last:  # post the send and the receive together; both return now
            incoming = torch.empty_like(kv)
            send = dist.P2POp(dist.isend, kv, (rank + 1) % world)
            receive = dist.P2POp(dist.irecv, incoming, (rank - 1) % world)
            requests = dist.batch_isend_irecv([send, receive])
            sent += kv.numel() * kv.element_size()
        k, v = kv[..., :dim], kv[..., dim:]
        keys = keys_at[(rank - step) % world]  # the positions of this shard
        with TileCounter() as counter:  # counts the tiles computed, not skipped
            part = attend(q, k, v, queries_at, keys)  # (out, lse) of this shard
        tiles.append(counter.tiles)
        out, lse = part if out is None else merge_attention(out, lse, *part)
        if not last:
            for request in requests:
                request.wait()  # returns once this transfer is complete
            kv = incoming  # the left neighbour's shard, for the next step
    return out, lse, tiles, sent


def _ring_job(rank, world, job, device):
    """One process's part of a job: its shard of q, k, v through `ring_loop`."""
    q, k, v = (job[name].to(device) for name in "qkv")  # this process's shards
    order, length = job["order"], job["length"]
    keys_at = [shard_positions(order, s, world, length).to(device) for s in range(world)]
    mine = keys_at[rank]
    # Non-causal: every query "sits" at the last position and sees every key.
    queries_at = mine if job["causal"] else torch.full_like(mine, length - 1)
    kv = torch.cat([k, v], dim=-1)  # K and V as one message
    out, _, tiles, sent = ring_loop(rank, world, q, kv, queries_at, keys_at, job["tile"])
    return dict(out=out.cpu(), positions=mine.cpu(), tiles=tiles, sent=sent)


def _shard_of(job, rank, world):
    """The part of a job {q, k, v, order, causal, tile} that process `rank` holds."""
    length = job["q"].shape[2]
    if job["k"].shape[2] != length:
        raise ValueError("ring attention here shards one sequence: T queries and T keys")
    mine = shard_positions(job["order"], rank, world, length)
    shards = {name: job[name][:, :, mine].clone() for name in "qkv"}
    return {**job, **shards, "length": length}


def ring_worker(rank, world, port, backend, folder, fail_rank, timeout):
    """One process of the ring: read its shards from `folder`, join the group, run every job,
    save the results to `folder`."""
    jobs = torch.load(os.path.join(folder, f"in{rank}.pt"))  # this process's shards only
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
    )
    try:
        if rank == fail_rank:
            raise RuntimeError(f"process {rank} failed on purpose")
        results = [_ring_job(rank, world, job, device) for job in jobs]
        torch.save(results, os.path.join(folder, f"rank{rank}.pt"))
    except Exception as error:  # note when, so the parent can name the first failure
        with open(os.path.join(folder, f"failed{rank}.txt"), "w") as note:
            note.write(f"{time.time()!r} process {rank}: {type(error).__name__}: {error}")
        raise
    finally:
        dist.destroy_process_group()


def _first_failure(folder) -> str:
    """The failure noted first by a worker, or '' if none was noted."""
    notes = [name for name in os.listdir(folder) if name.startswith("failed")]
    texts = sorted(open(os.path.join(folder, name)).read() for name in notes)
    return min(texts, key=lambda text: float(text.split()[0])).split(" ", 1)[1] if texts else ""


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RingResult(NamedTuple):
    out: torch.Tensor  # [B, Hq, T, Dv], in sequence order
    tiles: List[int]  # tiles computed, per process, counted by the process (TileCounter)
    tiles_per_step: List[List[int]]  # [process][step], the same count step by step
    bytes_sent: List[int]  # bytes of K and V each process sent
    seconds: float  # wall clock of the whole run, process start-up included


def _stop(context) -> None:
    for process in context.processes:
        if process.is_alive():
            process.terminate()
    for process in context.processes:
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join()


def ring_runs(
    jobs, world, backend="gloo", timeout=60.0, fail_rank=None, start_method="spawn"
) -> list:
    """Run each job {q, k, v, order, causal, tile} on one ring of `world` processes.

    Returns a RingResult per job. Raises TimeoutError after `timeout` seconds, and
    RuntimeError when a process fails; either way no process is left running.
    start_method "spawn" starts a fresh Python per process; "forkserver" imports this module
    once in a server process and forks every worker from it (much faster to start).
    """
    if start_method == "forkserver":  # takes effect when the server starts, the first time
        multiprocessing.set_forkserver_preload([__name__])
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        for rank in range(world):  # each process will load its own shards, nothing more
            shards = [_shard_of(job, rank, world) for job in jobs]
            torch.save(shards, os.path.join(folder, f"in{rank}.pt"))
        args = (world, free_port(), backend, folder, fail_rank, timeout)
        context = mp.start_processes(
            ring_worker, args, nprocs=world, join=False, start_method=start_method
        )
        quiet, level = SPAWN_LOG, SPAWN_LOG.level  # silence "Terminating process ..."
        quiet.setLevel(logging.ERROR)
        try:
            while not context.join(timeout=0.1):
                if time.perf_counter() - start > timeout:
                    raise TimeoutError(f"the ring of {world} did not finish in {timeout} s")
        except ProcessException as error:
            first = _first_failure(folder) or str(error)
            raise RuntimeError(f"a ring process failed; the first: {first}") from None
        finally:
            _stop(context)
            quiet.setLevel(level)
        ranks = [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(world)]
    seconds = time.perf_counter() - start
    return [_collect(job, [rank[j] for rank in ranks], seconds) for j, job in enumerate(jobs)]


def _collect(job, parts, seconds) -> RingResult:
    """Put the processes' output shards back in sequence order."""
    out = torch.empty(job["q"].shape[:3] + job["v"].shape[3:], dtype=job["q"].dtype)
    for part in parts:
        out[:, :, part["positions"]] = part["out"].to(out.dtype)
    per_step, sent = [part["tiles"] for part in parts], [part["sent"] for part in parts]
    return RingResult(out, [sum(steps) for steps in per_step], per_step, sent, seconds)


def ring_attention(q, k, v, world, order="contiguous", causal=True, tile=16, **options):
    """Attention of q [B, Hq, T, D] to k, v [B, Hkv, T, D] on a ring of `world` processes.

    Equals `causal_attention(q, k, v)` (or with causal=False) to float tolerance; `options`
    go to `ring_runs`: backend ("gloo"; "nccl", one GPU per process, is written but has not
    been run on GPUs), timeout, fail_rank, start_method. Returns a RingResult.
    """
    job = {"q": q, "k": k, "v": v, "order": order, "causal": causal, "tile": tile}
    return ring_runs([job], world, **options)[0]
