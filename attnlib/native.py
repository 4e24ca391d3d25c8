"""The loops of attnlib.loops compiled from attnlib/csrc: C++ and Rust, called through ctypes.

Each library is built once into $ATTNLIB_CACHE (default ~/.cache/attnlib/native), named by a hash
of its source and the compiler's --version, so later calls and later processes only load it.
"""

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from .attention import check_scale

SOURCES = {"cpp": "attention.cpp", "rust": "attention.rs"}
COMMANDS = {"cpp": "g++ -O2 -shared -fPIC", "rust": "rustc -O --crate-type cdylib"}
# The one permission the dot product's sum needs to be spread over vector lanes: reassociate
# float additions (signed zeros and traps would forbid it). Unlike -ffast-math, it links no
# start-up code that changes how the process rounds subnormal numbers.
REORDER = "-fassociative-math -fno-signed-zeros -fno-trapping-math"
INTEGERS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def compiler(language):
    """The path of the compiler for `language` ('cpp' or 'rust'), or None where there is none."""
    if language not in SOURCES:
        raise ValueError(f"language must be 'cpp' or 'rust', got {language!r}")
    rustup = Path.home() / ".cargo" / "bin" / "rustc"  # often not on PATH
    found = shutil.which(COMMANDS[language].split()[0])
    return found or (str(rustup) if language == "rust" and rustup.is_file() else None)


def compiler_missing(language="cpp"):
    """None if `language` ('cpp' or 'rust') compiles here, else one line saying what to install."""
    name = None if compiler(language) else COMMANDS[language].split()[0]
    return name and f"{name} not found: install it (e.g. `apt-get install {name}`) and rerun"


def library(language="cpp", flags=None):
    """The path of attnlib/csrc/attention.{cpp,rs} compiled with `flags` (COMMANDS' by default),
    compiled into the cache first if it is not there yet."""
    found, source = compiler(language), Path(__file__).parent / "csrc" / SOURCES[language]
    if found is None:
        raise RuntimeError(compiler_missing(language))
    flags = (COMMANDS[language].split(maxsplit=1)[1] if flags is None else flags).split()
    version = subprocess.run([found, "--version"], capture_output=True, check=True).stdout
    key = hashlib.sha256(source.read_bytes() + version + " ".join(flags).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("ATTNLIB_CACHE", "~/.cache/attnlib/native")).expanduser()
    path = cache / f"attention-{language}-{key}.so"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        partial = cache / f"{path.name}.{os.getpid()}.tmp"
        command = [found, *flags, str(source), "-o", str(partial)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr}")
        os.replace(partial, path)  # atomic: no process ever loads half a library
    return path


@functools.lru_cache(maxsize=None)
def build(language="cpp", flags=None):
    """Compile attnlib/csrc/attention.{cpp,rs} with `flags` (COMMANDS' by default); load it."""
    kernel = ctypes.CDLL(str(library(language, flags))).attention
    p, n = ctypes.c_void_p, ctypes.c_int64  # pointer, int64
    kernel.argtypes, kernel.restype = [p, p, p, n, n, p, p, ctypes.c_float, n, n, n, n, p], None
    return kernel


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


def _rows(name, x, heads, layout):
    """x [N, heads*width] as contiguous float32 on the CPU, and its width per head."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a 2-D tensor {layout}, got {got}")
    if type(heads) is not int or heads < 1 or x.shape[1] < heads or x.shape[1] % heads:
        raise ValueError(f"{name}'s heads ({heads!r}) must be a whole number dividing its "
                         f"{x.shape[1]} features")  # fmt: skip
    return x.detach().to("cpu", torch.float32).contiguous(), x.shape[1] // heads


def _positions(name, positions, length, start):
    """Positions as contiguous int64 [length]; the default is start .. start+length-1."""
    default = positions is None
    positions = torch.arange(start, start + length) if default else torch.as_tensor(positions)
    if positions.dtype not in INTEGERS or tuple(positions.shape) != (length,):
        got = f"{positions.dtype} of shape {list(positions.shape)}"
        raise ValueError(f"{name} must be {length} integers [{length}], got {got}")
    return positions.to("cpu", torch.int64).contiguous()


def native_attention(q, k, v, q_heads, kv_heads, query_positions=None, key_positions=None,
                     scale=None, language="cpp", flags=None):  # fmt: skip
    """Eqs. 2.2, 4.1, 7.1 and 9.1 as compiled loops over one sequence (see attnlib.loops).

    q [T, Hq*D], k [S, Hkv*D], v [S, Hkv*Dv] -> float32 [T, Hq*Dv]; language 'cpp' or 'rust',
    built with `flags` (see build)."""
    q, dim = _rows("q", q, q_heads, "[T, Hq*D]")
    k, key_dim = _rows("k", k, kv_heads, "[S, Hkv*D]")
    if q_heads % kv_heads:
        raise ValueError(
            "query heads (%d) must be a multiple of KV heads (%d)" % (q_heads, kv_heads)
        )
    v, value_dim = _rows("v", v, kv_heads, "[S, Hkv*Dv]")
    queries, keys, scale = q.shape[0], k.shape[0], check_scale(scale, dim)
    if v.shape[0] != keys:
        raise ValueError(f"k has {keys} rows (keys) but v has {v.shape[0]}")
    if key_dim != dim:
        raise ValueError(f"head size of q ({dim}) must equal that of k ({key_dim})")
    query_positions = _positions("query_positions", query_positions, queries, keys - queries)
    key_positions = _positions("key_positions", key_positions, keys, 0)
    kernel = build(language, flags)
    out = torch.zeros(queries, q_heads * value_dim, dtype=torch.float32)  # [T, Hq*Dv]
    if queries and keys:  # with no rows there is nothing to point at
        pointers = [x.data_ptr() for x in (q, k, v, query_positions, key_positions, out)]
        kernel(*pointers[:3], q_heads, kv_heads, *pointers[3:5], scale, queries, keys, dim,
               value_dim, pointers[5])  # fmt: skip
    return out


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
    text = (Path(__file__).parent / "csrc" / SOURCES["cpp"]).read_text().splitlines()
    return {
        name: 1 + next(n for n, line in enumerate(text) if body in line)
        for name, body in LOOPS.items()
    }


def gcc_loop_notes(flags):
    """{loop: notes} from g++'s vectoriser on attention.cpp compiled with `flags`: the vector size
    (or "scalar") first, then the reasons it gave, in GCC_NOTES' short names."""
    source = Path(__file__).parent / "csrc" / SOURCES["cpp"]
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
        source = (Path(__file__).parent / "csrc" / SOURCES["rust"]).read_text()
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
    """In a fresh Python: 1e-40 * 1 in float32 before and after loading the library at `path`.

    A library linked with -ffast-math runs start-up code that sets flush-to-zero and
    denormals-are-zero on the loading thread, after which the product is 0.0."""
    done = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True,
                          text=True, check=True)  # fmt: skip
    before, after = done.stdout.split()
    return float(before), float(after)
