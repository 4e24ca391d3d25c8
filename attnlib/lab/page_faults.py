"""Page faults: how often the operating system hands a call fresh memory, and what one costs.

A minor page fault happens the first time a process touches a page the kernel has mapped for
it but not yet backed: the kernel finds a free page, zero-fills it and maps it, with no disk
read. `minor_faults` counts them around one call with `getrusage`. `fresh_page_seconds`
prices one: it fills a newly allocated tensor (every page faults) and one that already exists
(no page faults), and divides the difference by the pages. Both numbers belong to this
machine, its kernel and its C library's allocator, and change from run to run.
"""

import os
import resource
from typing import Callable

import torch

from .timing import median_seconds

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def minor_faults(call: Callable[[], object]) -> int:
    """Minor page faults (no disk read) this process takes while `call()` runs."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    call()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def fresh_page_seconds(nbytes: int = 32 * 2**20, repeats: int = 5) -> float:
    """Seconds one fresh page costs: filling a new float32 tensor of `nbytes` minus filling an
    existing one, per page. Large sizes (32 MiB by default) make glibc map new memory each time."""
    if nbytes < PAGE_BYTES:
        raise ValueError(f"nbytes must be at least one page ({PAGE_BYTES}), got {nbytes}")
    floats = nbytes // 4
    existing = torch.empty(floats)
    fill_new = median_seconds(lambda: torch.empty(floats).fill_(1.0), repeats)
    fill_old = median_seconds(lambda: existing.fill_(1.0), repeats)
    return (fill_new - fill_old) / (nbytes / PAGE_BYTES)
