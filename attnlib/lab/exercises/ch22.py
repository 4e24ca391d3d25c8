"""Chapter 22, ring attention: causal attention shard by shard of the keys, merged."""

import builtins
import importlib
import linecache
import logging
import marshal
import math
import multiprocessing
import os
import pickle
import tempfile
import time
import traceback
import types
from datetime import timedelta

import torch

from ...merge import merge_attention
from ...softmax import softmax
from .cases import f64, randn, tril
from .core import Bug, Case, Exercise, Section

CHAPTER = "22_ring_attention"
THE_RING = Section(CHAPTER, "22.2", "The ring")

BUGS = {
    "ring_partials_averaged": Bug(
        "The shards' partial outputs were averaged; merge them with their log-sum-exps "
        "(eq. 21.1), so that each shard counts with its share of the softmax.",
        THE_RING,
    ),
    "ring_empty_shard_nan": Bug(
        "A shard wholly in a query's future makes a softmax over a row of -inf, NaN, and NaN "
        "times the weight 0 is still NaN: such a partial must be 0 with lse = -inf.",
        THE_RING,
    ),
}


def _shard_partials(q, k, v, processes, torch_softmax=False):
    """Per contiguous shard of the keys: (out, lse) of every query over that shard (causal)."""
    q, k, v = f64(q, k, v)
    t, size = q.shape[2], q.shape[2] // processes
    parts = []
    for j0 in range(0, t, size):
        visible = tril(t, t)[:, j0 : j0 + size]  # [T, size]
        scores = (q @ k[:, :, j0 : j0 + size].transpose(-2, -1)) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~visible, -math.inf)
        weights = torch.softmax(scores, -1) if torch_softmax else softmax(scores)
        parts.append((weights @ v[:, :, j0 : j0 + size], scores.logsumexp(-1)))
    return parts


def _ring(q, k, v, processes, torch_softmax=False):
    parts = _shard_partials(q, k, v, processes, torch_softmax)
    out, lse = parts[0]
    for part in parts[1:]:
        out, lse = merge_attention(out, lse, *part)
    return out


def _averaged(q, k, v, processes):
    parts = _shard_partials(q, k, v, processes)
    seen = torch.stack([torch.isfinite(lse) for _, lse in parts]).double().sum(0)  # [B, H, T]
    return sum(out for out, _ in parts) / seen[..., None]


def _cases():
    gen, cases = torch.Generator().manual_seed(21), []
    for b, h, t, d, processes in [
        (1, 2, 8, 4, 2),
        (2, 1, 12, 8, 3),
        (1, 2, 8, 4, 4),
        (1, 1, 6, 4, 1),
    ]:
        q, k, v = (randn(gen, b, h, t, d) for _ in range(3))
        cases.append(Case((q, k, v, processes), f"B={b}, H={h}, T={t}, D={d}, N={processes}"))
    return cases


EXERCISES = {
    "ring_attention_simulated": Exercise(
        "fn(q, k, v, processes) -> out; q, k, v [B, H, T, D], T a multiple of processes",
        "Causal attention computed shard by shard: the keys in `processes` contiguous shards, "
        "each shard's partial (out, lse) for every query, merged.",
        _cases,
        _ring,
        ("out [B, H, T, D]",),
        {
            "ring_partials_averaged": _averaged,
            "ring_empty_shard_nan": lambda q, k, v, p: _ring(q, k, v, p, torch_softmax=True),
        },
    ),
}


# ---- Exercise 22.4: one step of the ring, run on two gloo processes --------------------------
#
# The reader's function runs in other processes. A process started by `forkserver` or `spawn`
# finds a function by importing its module, and a notebook is no module, so `on_two_processes`
# sends the function by value instead: its compiled code (marshal), its defaults, and the
# globals it reads (modules and importable functions by name, the reader's other functions
# likewise by value, anything else pickled). The processes are started the way `ring_runs`
# starts them: `torch.multiprocessing` with `forkserver`, a worker importable from this module,
# gloo at an address on this machine, and every process stopped when the run ends, fails or
# outlasts its timeout.

WORLD = 2  # processes of the exercise
WORK_THE_MASK = Section(CHAPTER, "22.3", "Who does the work under the causal mask")

BUGS.update(
    {
        "ring_step_own_shard": Bug(
            "Each process attended to its own keys and values, the shard of step 0. After the "
            "exchange it holds the shard of rank - 1, and that is the one to attend to.",
            THE_RING,
        ),
        "ring_step_local_positions": Bug(
            "The received keys were given the positions 0 .. n - 1, as if they were this "
            "process's own: the causal rule then sees a triangle in every shard. A shard keeps "
            "its true positions, source * n onwards, so a shard wholly in the queries' future "
            "shows nothing and one wholly in their past shows everything.",
            WORK_THE_MASK,
        ),
    }
)


def _step_reference(q, k, v, received=None, local=False, torch_softmax=False):
    """Every process's partial (out, lse) over the shard it receives, in sequence order."""
    q, k, v = f64(q, k, v)
    n = q.shape[2] // WORLD
    outs, lses = [], []
    for rank in range(WORLD):
        source = (rank - 1) % WORLD if received is None else received(rank)
        mine, theirs = slice(rank * n, rank * n + n), slice(source * n, source * n + n)
        query_pos = torch.arange(n) if local else torch.arange(mine.start, mine.stop)
        key_pos = torch.arange(n) if local else torch.arange(theirs.start, theirs.stop)
        scores = q[:, :, mine] @ k[:, :, theirs].transpose(-2, -1) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], -math.inf)
        weights = torch.softmax(scores, -1) if torch_softmax else softmax(scores)
        outs.append(weights @ v[:, :, theirs])
        lses.append(scores.logsumexp(-1))
    return torch.cat(outs, 2), torch.cat(lses, 2)


def _step_cases():
    gen, cases = torch.Generator().manual_seed(22), []
    for b, h, t, d in [(1, 2, 8, 4), (2, 1, 6, 8), (1, 3, 4, 2)]:
        q, k, v = (randn(gen, b, h, t, d) for _ in range(3))
        cases.append(Case((q, k, v), f"B={b}, H={h}, T={t}, D={d}, {WORLD} processes"))
    return cases


EXERCISES["ring_step"] = Exercise(
    "fn(q, k, v) -> (out, lse); q, k, v [B, H, T, D] cut into 2 shards of n = T / 2 positions",
    "One step of the ring on two gloo processes: each sends its K/V shard to rank + 1, "
    "receives rank - 1's with batch_isend_irecv, and returns its queries' partial (out, lse) "
    "over the received shard, with true positions; run through on_two_processes.",
    _step_cases,
    _step_reference,
    ("out [B, H, T, D]", "lse [B, H, T]"),
    {
        "ring_step_own_shard": lambda q, k, v: _step_reference(q, k, v, received=lambda r: r),
        "ring_step_local_positions": lambda q, k, v: _step_reference(q, k, v, local=True),
        "ring_empty_shard_nan": lambda q, k, v: _step_reference(q, k, v, torch_softmax=True),
    },
)


def _global_names(code) -> set:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _reference_to(value, namespace, packing):
    """How a worker gets one global the function reads: ("module", name), ("import", module,
    qualname), ("function", packed) for the reader's own functions, or ("value", pickled)."""
    if isinstance(value, types.ModuleType):
        return ("module", value.__name__)
    if isinstance(value, types.FunctionType) and value.__globals__ is namespace:
        return ("function", _pack(value, packing)) if value.__name__ not in packing else None
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if module and qualname and module != "__main__" and "<" not in qualname:
        try:
            found = importlib.import_module(module)
            for part in qualname.split("."):
                found = getattr(found, part)
            if found is value:
                return ("import", module, qualname)
        except Exception:
            pass
    try:
        return ("value", pickle.dumps(value))
    except Exception:  # not needed after all (an attribute's name), or NameError over there
        return None


def _pack(fn, packing=None) -> dict:
    """fn by value: its code, defaults and the globals it reads; its source lines travel too,
    so that an error over there can name the reader's line."""
    packing = set() if packing is None else packing
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"expected a function defined with def, got {type(fn).__name__}")
    if fn.__closure__:
        raise ValueError(
            f"{fn.__name__} reads variables of the function around it; define it at the top "
            "level of a cell"
        )
    packing.add(fn.__name__)
    globals_ = {}
    for name in sorted(_global_names(fn.__code__)):
        if name in fn.__globals__:
            found = _reference_to(fn.__globals__[name], fn.__globals__, packing)
            if found is not None:
                globals_[name] = found
    filename = fn.__code__.co_filename
    return dict(
        name=fn.__name__,
        code=marshal.dumps(fn.__code__),
        defaults=fn.__defaults__,
        kwdefaults=fn.__kwdefaults__,
        globals=globals_,
        filename=filename,
        lines=linecache.getlines(filename),
    )


def _unpack(packed: dict, namespace: dict):
    """The function of `_pack`, rebuilt over `namespace` (shared by the reader's functions)."""
    namespace.setdefault("__builtins__", builtins)
    namespace.setdefault("__name__", "__main__")
    for name, found in packed["globals"].items():
        kind = found[0]
        if kind == "module":
            namespace[name] = importlib.import_module(found[1])
        elif kind == "import":
            value = importlib.import_module(found[1])
            for part in found[2].split("."):
                value = getattr(value, part)
            namespace[name] = value
        elif kind == "value":
            namespace[name] = pickle.loads(found[1])
        elif name not in namespace:
            namespace[name] = _unpack(found[1], namespace)
    lines = packed["lines"]
    if lines:
        linecache.cache[packed["filename"]] = (sum(map(len, lines)), None, lines, "")
    fn = types.FunctionType(
        marshal.loads(packed["code"]), namespace, packed["name"], packed["defaults"]
    )
    fn.__kwdefaults__ = packed["kwdefaults"]
    return fn


def _readers_line(err: BaseException, filename: str) -> str:
    """' at line N, `text`' for the innermost frame of the reader's code, else ''."""
    found = ""
    for frame, number in traceback.walk_tb(err.__traceback__):
        if frame.f_code.co_filename == filename:
            text = linecache.getline(filename, number).strip()
            found = f" at line {number}" + (f", `{text}`" if text else "")
    return found


def _step_worker(rank, world, port, folder, timeout):
    """One process: rebuild the reader's function, join the gloo group, run it on this rank's
    shards, save what it returns (or what it raised)."""
    import torch.distributed as dist

    with open(os.path.join(folder, "job.pkl"), "rb") as file:
        job = pickle.load(file)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    try:
        step = _unpack(job["fn"], {})
        n = job["q"].shape[2] // world
        shards = [job[name][:, :, rank * n : rank * n + n].clone() for name in "qkv"]
        out = step(*shards, rank, world)
        if isinstance(out, (tuple, list)):
            out = type(out)(o.detach().cpu() if torch.is_tensor(o) else o for o in out)
        elif torch.is_tensor(out):
            out = out.detach().cpu()
        result = ("returned", out)
    except Exception as error:
        where = _readers_line(error, job["fn"]["filename"])
        result = ("raised", type(error).__name__, str(error), where, time.time())
    path = os.path.join(folder, f"rank{rank}.pkl")
    with open(path + ".part", "wb") as file:
        pickle.dump(result, file)
    os.replace(path + ".part", path)  # the parent never reads half a file
    dist.destroy_process_group()


def _results(folder, world, kind=None) -> dict:
    """rank -> what its process saved, for the ranks that saved (only `kind` if given)."""
    found = {}
    for rank in range(world):
        path = os.path.join(folder, f"rank{rank}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as file:
                result = pickle.load(file)
            if kind is None or result[0] == kind:
                found[rank] = result
    return found


def _gathered(outs):
    """The processes' outputs put back in sequence order: tensors joined along positions."""
    first = outs[0]
    if torch.is_tensor(first) and all(torch.is_tensor(o) for o in outs) and first.dim() >= 3:
        return torch.cat(outs, 2)
    if isinstance(first, (tuple, list)) and all(
        isinstance(o, (tuple, list)) and len(o) == len(first) for o in outs
    ):
        parts = list(zip(*outs))
        if all(torch.is_tensor(p) and p.dim() >= 3 for part in parts for p in part):
            return tuple(torch.cat(part, 2) for part in parts)
    return first  # something else: the checker says what it expected


def run_step(step, q, k, v, world=WORLD, timeout=60.0):
    """Run step(q_r, k_r, v_r, rank, world) in `world` gloo processes, process r holding
    contiguous shard r of q, k, v [B, H, T, D]; return its outputs in sequence order.

    A process that raised is reported as the same exception type (message: the process, the
    reader's line, the error); a run past `timeout` seconds raises TimeoutError. No process is
    left running.
    """
    if q.shape[2] % world:
        raise ValueError(f"T ({q.shape[2]}) must be a multiple of the processes ({world})")
    job = dict(fn=_pack(step), q=q.detach().cpu(), k=k.detach().cpu(), v=v.detach().cpu())
    multiprocessing.set_forkserver_preload([__name__])  # the first time the server starts
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "job.pkl"), "wb") as file:
            pickle.dump(job, file)
        _run_workers(folder, world, timeout)
        results = _results(folder, world)
    _reraise(results)
    return _gathered([results[rank][1] for rank in range(world)])


def _run_workers(folder, world, timeout):
    """Start the workers on the job in `folder` and wait for them, or for the first to raise."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    from ..ring import SPAWN_LOG, _stop, free_port

    start = time.perf_counter()
    args = (world, free_port(), folder, timeout)
    context = mp.start_processes(
        _step_worker, args, nprocs=world, join=False, start_method="forkserver"
    )
    level = SPAWN_LOG.level
    SPAWN_LOG.setLevel(logging.ERROR)
    try:
        while not context.join(timeout=0.1):
            if _results(folder, world, "raised"):  # the others may wait for it for ever
                break
            if time.perf_counter() - start > timeout:
                raise TimeoutError(
                    f"the {world} processes did not finish in {timeout:g} s: a receive "
                    "that no process sends to waits for ever"
                )
    except ProcessException as error:
        raise RuntimeError(f"a process ended abruptly: {error}") from None
    finally:
        _stop(context)
        SPAWN_LOG.setLevel(level)


def _reraise(results):
    """Raise the error of the first process that raised, as its own type where it can."""
    raised = sorted((result[4], rank) for rank, result in results.items() if result[0] == "raised")
    if not raised:  # the first to fail names the cause; a neighbour's lost connection follows
        return
    rank = raised[0][1]
    _, kind, message, where, _ = results[rank]
    if kind == "NotImplementedError":
        raise NotImplementedError(message)
    error = getattr(builtins, kind, None)
    error = error if isinstance(error, type) and issubclass(error, Exception) else None
    text = f"in process {rank}{where}: {message}"
    raise (error or RuntimeError)(text if error else f"{kind} {text}")


def on_two_processes(step):
    """fn(q, k, v) for `check`: runs step(q, k, v, rank, world) on two gloo processes, each on
    its contiguous shard, and returns what they return, in sequence order."""
    if not callable(step):
        return step  # the checker says what it expected

    def on_processes(q, k, v):
        return run_step(step, q, k, v)

    return on_processes
