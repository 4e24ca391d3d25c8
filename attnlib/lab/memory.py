"""Peak memory of one call, measured two independent ways: PyTorch's allocator and the OS.

How: `peak_allocated_bytes` replays every allocation and free that PyTorch's CPU allocator reports
to the profiler (profile_memory=True) and returns the highest running total: the bytes the
call held at its worst moment beyond what existed before it, its output included.
`held_allocated_bytes` replays the same log to its end: what the call allocated and still holds.
`peak_rss_bytes` asks Linux instead: it resets the process's resident high-water mark (VmHWM)
and reports how far it rose above the resident size at the start. The two agree for large
tensors; memory that bypasses PyTorch's allocator (BLAS scratch space) only the second sees.
"""

import contextlib
import os
import re
import sys
from typing import Callable


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2, where Kineto logs a timestamped line as it starts and stops."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _allocation_event_type():
    """The profiler's event tag for allocations: a private torch API, so check that it exists."""
    try:
        from torch._C._profiler import _EventType

        return _EventType.Allocation
    except (ImportError, AttributeError) as error:
        raise RuntimeError(
            "peak_allocated_bytes needs torch's private profiler API (torch._C._profiler."
            f"_EventType.Allocation, present in torch 2.5 to 2.13), which this torch lacks: {error}"
        ) from None


def _allocation_log(fn: Callable[[], object]) -> list:
    """(time in ns, bytes) of every allocation (+) and free (-) PyTorch's CPU allocator reports
    to the profiler while fn() runs, in order of time."""
    allocation = _allocation_event_type()
    # The engine under torch.profiler.profile, which on first use also imports torch._inductor.
    from torch.autograd.profiler import profile

    prof = profile(use_cpu=True, profile_memory=True)
    with _quiet_stderr():
        prof.__enter__()
    try:
        fn()
    finally:
        with _quiet_stderr():
            prof.__exit__(None, None, None)
    sizes = []
    stack = list(prof.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == allocation:
            sizes.append((node.start_time_ns, node.extra_fields.alloc_size))  # bytes, - = free
        stack.extend(node.children)
    return sorted(sizes)


def peak_allocated_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes held by PyTorch's CPU allocator during fn(), above the level when it started."""
    held = peak = 0
    for _, size in _allocation_log(fn):  # whole numbers of bytes: no NaN to hide
        held += size
        if held > peak:
            peak = held
    return peak


def held_allocated_bytes(fn: Callable[[], object]) -> int:
    """Bytes that fn() allocated through PyTorch's CPU allocator and still holds when it returns:
    what a KV cache keeps, to hold against eq. 10.1.

    Allocations less frees, so it is negative where fn() frees more than it keeps (a tensor made
    before the call and released during it). A value fn() returns is dropped as it returns, so it
    is not held: to count a result, keep it (in a list, a cache). The allocator reports the size
    of a free only for memory it handed out while some measurement ran (PyTorch warns "Memory
    block of unknown size"), so measure the calls that build what a later call frees too.
    """
    return sum(size for _, size in _allocation_log(fn))


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"^{key}:\s+(\d+) kB", status.read(), re.M).group(1)) * 1024


def peak_rss_bytes(fn: Callable[[], object]) -> int:
    """Peak resident memory of this process during fn(), above its resident size before (Linux).

    Writing 5 to /proc/self/clear_refs resets the high-water mark VmHWM (Linux >= 4.0).
    """
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError as error:
        raise ValueError(f"peak_rss_bytes needs Linux's /proc/self/clear_refs: {error}") from None
    start = _status_bytes("VmRSS")
    fn()
    return max(_status_bytes("VmHWM") - start, 0)
