"""Chapter 11's look inside the compiled loops of attnlib.native: what the vectorisers did.

`gcc_loop_notes` and `rust_loop_notes` read g++'s vectoriser dump and rustc's LLVM IR and name
what each decided about the two innermost loops; `build_seconds` times a compile and a cached
load; `subnormal_product` shows what loading a -ffast-math library does to the loading process.
The engine (attnlib.native) builds, loads and calls the libraries; nothing there imports this.
"""

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
    "Loop costings not worthwhile": "not worth it",
}


def loop_lines():
    """{loop: its line in attention.cpp} for the two innermost loops."""
    text = (CSRC / SOURCES["cpp"]).read_text().splitlines()
    return {
        name: 1 + next(n for n, line in enumerate(text) if body in line)
        for name, body in LOOPS.items()
    }


def gcc_loop_notes(flags):
    """{loop: notes} from g++'s vectoriser on attention.cpp compiled with `flags`: the vector size
    (or "scalar") first, then the reasons it gave, in GCC_NOTES' short names."""
    source = CSRC / SOURCES["cpp"]
    with tempfile.TemporaryDirectory() as folder:
        dump = Path(folder) / "vect.txt"
        command = ["g++", *flags.split(), "-fPIC", "-c", str(source)]
        command += [f"-fdump-tree-vect-details={dump}", "-o", os.devnull]
        subprocess.run(command, check=True, capture_output=True)
        text = dump.read_text()
    notes = {}
    for name, line in loop_lines().items():
        mine = "\n".join(re.findall(rf":{line}:\d+: (.*)", text))
        size = re.search(r"loop vectorized using (\d+) byte vectors", mine)
        said = [f"{size.group(1)}-byte vectors" if size else "scalar"]
        notes[name] = said + [short for note, short in GCC_NOTES.items() if note in mine]
    return notes


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


PROBE = """import ctypes, sys
import numpy as np
tiny = np.float32(1e-40)  # a subnormal float32: below the smallest normal, 1.2e-38
before = float(tiny * np.float32(1))
ctypes.CDLL(sys.argv[1])
print(before, float(tiny * np.float32(1)))
"""


def subnormal_product(path):
    """In a fresh Python: 1e-40 * 1 in float32 before and after loading the library at `path`
    (see attnlib.native.library).

    A library linked with -ffast-math runs start-up code that sets flush-to-zero and
    denormals-are-zero on the loading thread, after which the product is 0.0."""
    done = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True,
                          text=True, check=True)  # fmt: skip
    before, after = done.stdout.split()
    return float(before), float(after)
