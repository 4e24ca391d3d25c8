"""Chapter 11's look inside the compiled loops of attnlib.native: what the vectorisers did.

`gcc_loop_notes` and `rust_loop_notes` read g++'s vectoriser dump and rustc's LLVM IR and name
what each decided about the two innermost loops; `restrict_pointers` adds C++'s no-overlap
promise to the source; `build_seconds` times a compile and a cached load; `subnormal_product` and
`subnormal_by_thread` show what loading a -ffast-math library does to the threads of a process.
The engine (attnlib.native) builds, loads and calls the libraries; nothing there imports this.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from attnlib.native import SOURCES, build, compiler

CSRC = Path(__file__).resolve().parent.parent / "csrc"
# The one permission the dot product's sum needs to be spread over vector lanes: reassociate
# float additions (signed zeros and traps would forbid it). Unlike -ffast-math, it links no
# start-up code that changes how the process rounds subnormal numbers.
REORDER = "-fassociative-math -fno-signed-zeros -fno-trapping-math"


def build_seconds(language="cpp"):
    """Seconds of a compile into an empty cache, then of a load from that cache (as a new
    process would load it); the usual cache is left as it was."""
    seconds = []
    with tempfile.TemporaryDirectory() as cache, mock.patch.dict(os.environ, ATTNLIB_CACHE=cache):
        for _ in range(2):
            build.cache_clear()  # forget the loaded library
            start = time.perf_counter()
            build(language)
            seconds.append(time.perf_counter() - start)
    build.cache_clear()
    return tuple(seconds)


# What the vectorisers decided about the two innermost loops: the dot product of a query with a
# key (eq. 3.3) and the weighted sum of the values (eq. 2.2).
LOOPS = {"dot product": "dot += query[e] * key[e]", "weighted sum": "row[e] += weight * value[e]"}
GCC_NOTES = {  # what g++'s -fdump-tree-vect-details writes, and a short name for it
    "loop versioned for vectorization": "overlap checked at run time",
    "would need a runtime alias check": "would need a run-time overlap check",
    "using an in-order (fold-left) reduction": "sum in source order",
    "Reduce using direct vector reduction": "sum spread over the lanes",
    # -O2's cheapest cost model refuses any scalar iterations peeled off before or after the
    # vector loop, which a loop of unknown length needs for the leftover elements
    "some scalar iterations would need to be peeled": "needs a scalar tail",
    "Loop costings not worthwhile": "not worth it",
}


def loop_lines(source=None):
    """{loop: its line in `source` (attention.cpp by default)} for the two innermost loops."""
    text = ((CSRC / SOURCES["cpp"]).read_text() if source is None else source).splitlines()
    return {
        name: 1 + next(n for n, line in enumerate(text) if body in line)
        for name, body in LOOPS.items()
    }


def gcc_loop_notes(flags, source=None):
    """{loop: notes} from g++'s vectoriser on `source` (attention.cpp by default) compiled with
    `flags`: the vector size (or "scalar") first, then the reasons it gave, in GCC_NOTES' short
    names."""
    if source is None:
        source = (CSRC / SOURCES["cpp"]).read_text()
    with tempfile.TemporaryDirectory() as folder:
        dump, code = Path(folder) / "vect.txt", Path(folder) / "attention.cpp"
        code.write_text(source)
        command = ["g++", *flags.split(), "-fPIC", "-c", str(code)]
        command += [f"-fdump-tree-vect-details={dump}", "-o", os.devnull]
        subprocess.run(command, check=True, capture_output=True)
        text = dump.read_text()
    notes = {}
    for name, line in loop_lines(source).items():
        mine = "\n".join(re.findall(rf":{line}:\d+: (.*)", text))
        size = re.search(r"loop vectorized using (\d+) byte vectors", mine)
        said = [f"{size.group(1)}-byte vectors" if size else "scalar"]
        notes[name] = said + [short for note, short in GCC_NOTES.items() if note in mine]
    return notes


# The four arrays of attention.cpp's signature, and the same with C++'s no-overlap promise.
POINTERS = {
    "const float* q, const float* k, const float* v,":
        "const float* __restrict q, const float* __restrict k, const float* __restrict v,",
    "float* out) {": "float* __restrict out) {",
}  # fmt: skip


def restrict_pointers(source=None):
    """`source` (attention.cpp by default) with `__restrict` on q, k, v and out: the promise that
    no two of them overlap, as rustc's noalias is for reference parameters. Lines keep their
    numbers."""
    if source is None:
        source = (CSRC / SOURCES["cpp"]).read_text()
    for plain, restricted in POINTERS.items():
        if source.count(plain) != 1:
            raise ValueError(f"expected one {plain!r} in the source")
        source = source.replace(plain, restricted)
    return source


def rust_loop_notes(source=None):
    """{loop: notes} from the LLVM IR that `rustc -O` makes of `source` (attention.rs by default).

    Only the weighted sum has a weight to broadcast into a vector; `vector.memcheck` is the block
    that tests for overlap at run time, and `vector.reduce.fadd` a sum over the lanes."""
    if source is None:
        source = (CSRC / SOURCES["rust"]).read_text()
    with tempfile.TemporaryDirectory() as folder:
        code, ir = Path(folder) / "attention.rs", Path(folder) / "attention.ll"
        code.write_text(source)
        command = [compiler("rust"), "-O", "--crate-type", "cdylib", "--emit", "llvm-ir"]
        subprocess.run([*command, "-o", str(ir), str(code)], check=True, capture_output=True)
        text = ir.read_text()
    splat = re.search(r"insertelement <(\d+) x float> \w+, float %weight", text)
    weighted = [f"{4 * int(splat.group(1))}-byte vectors" if splat else "scalar"]
    if "vector.memcheck" in text:
        weighted.append("overlap checked at run time")
    summed = "vector.reduce.fadd" in text
    return {"dot product": ["vector sum" if summed else "scalar"], "weighted sum": weighted}


# Loads the library given as argv[1] in a fresh Python and prints, as JSON, the share of
# float32 products 1e-40 * 1 that came out zero: on the main thread before and after loading, on
# a thread started before loading and one started after, and in one multiplication by PyTorch
# on two threads, whose pool started before loading (first half: the main thread's share).
THREADS_PROBE = """import ctypes, json, sys, threading
import numpy as np
import torch

def zero():  # 1 if 1e-40 * 1 is zero on the calling thread; 1e-40 is a subnormal float32
    return float(np.float32(1e-40) * np.float32(1) == 0)

def pool():  # [2]: the share of zeros in each half of one multiplication on two threads
    return (tiny * 1 == 0).view(2, -1).double().mean(1).tolist()

torch.set_num_threads(2)
tiny = torch.full((1 << 20,), 1e-40)  # [N]: large enough that both threads take a half
go, seen = threading.Event(), {"main thread, before loading": zero()}
pool()  # starts PyTorch's worker pool
def wait_then_probe():
    go.wait()
    seen["a thread started before loading"] = zero()
early = threading.Thread(target=wait_then_probe)
early.start()
ctypes.CDLL(sys.argv[1])
seen["main thread"] = zero()
def probe():
    seen["a thread started after loading"] = zero()
late = threading.Thread(target=probe)
late.start()
late.join()
go.set()
early.join()
seen["PyTorch's pool: main thread's half"], seen["PyTorch's pool: other half"] = pool()
order = ["main thread, before loading", "main thread", "a thread started before loading",
         "a thread started after loading"]
print(json.dumps({key: seen.pop(key) for key in order} | seen))
"""


def subnormal_by_thread(path):
    """In a fresh Python: {where: the share of float32 products 1e-40 * 1 that are zero}, before
    and after loading the library at `path` (see attnlib.native.library), thread by thread.

    A library linked with -ffast-math runs start-up code that sets flush-to-zero and
    denormals-are-zero in the loading thread's own control register (MXCSR on x86). Threads
    started afterwards copy it; threads already running, PyTorch's pool among them, keep theirs."""
    done = subprocess.run([sys.executable, "-c", THREADS_PROBE, str(path)], capture_output=True,
                          text=True, check=True)  # fmt: skip
    return json.loads(done.stdout)


PROBE = """import ctypes, sys
import numpy as np
tiny = np.float32(1e-40)  # a subnormal float32: below the smallest normal, 1.2e-38
before = float(tiny * np.float32(1))
ctypes.CDLL(sys.argv[1])
print(before, float(tiny * np.float32(1)))
"""


def subnormal_product(path):
    """In a fresh Python: 1e-40 * 1 in float32 before and after loading the library at `path`
    (see attnlib.native.library), on the main thread only (subnormal_by_thread probes others).

    A library linked with -ffast-math runs start-up code that sets flush-to-zero and
    denormals-are-zero on the loading thread, after which the product is 0.0."""
    done = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True,
                          text=True, check=True)  # fmt: skip
    before, after = done.stdout.split()
    return float(before), float(after)
