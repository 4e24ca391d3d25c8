"""The loops of attnlib.loops compiled from attnlib/csrc: C++ and Rust, called through ctypes.

Each library is compiled once into a cache (see library); later calls and processes only load it.
"""

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

from .attention import check_scale

SOURCES = {"cpp": "attention.cpp", "rust": "attention.rs"}
COMMANDS = {"cpp": "g++ -O2 -shared -fPIC", "rust": "rustc -O --crate-type cdylib"}
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


def _cached(name: str, key: bytes, make) -> Path:
    """The cache's file for `key`, made by make(path) once, atomically, if it is not there yet."""
    cache = Path(os.environ.get("ATTNLIB_CACHE", "~/.cache/attnlib/native")).expanduser()
    path = cache / f"{name}-{hashlib.sha256(key).hexdigest()[:16]}.so"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        partial = cache / f"{path.name}.{os.getpid()}.tmp"
        make(partial)
        os.replace(partial, path)  # atomic: no process ever loads half a library
    return path


def _run(command) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr}")


def library(language="cpp", flags=None):
    """The path of attnlib/csrc/attention.{cpp,rs} built with `flags` into the cache, if not yet."""
    found, source = compiler(language), Path(__file__).parent / "csrc" / SOURCES[language]
    if found is None:
        raise RuntimeError(compiler_missing(language))
    flags = (COMMANDS[language].split(maxsplit=1)[1] if flags is None else flags).split()
    version = subprocess.run([found, "--version"], capture_output=True, check=True).stdout
    key = source.read_bytes() + version + " ".join(flags).encode()
    return _cached(f"attention-{language}", key, lambda out: _run([found, *flags, str(source),
                                                                  "-o", str(out)]))  # fmt: skip


# Tiled attention compiled (chapters 15 and 16): compiled with -ffast-math, which lets g++
# call glibc's vector exp2f, and linked without it, so that crtfastmath.o, which would switch
# the loading thread, and the threads started after it, to flush-to-zero when the library loads,
# is not linked in. -march=native: the key holds this CPU's flags, so another CPU builds its
# own; on x86, 512-bit vectors where the CPU has them (g++ otherwise stops at 256 bits, and the
# softmax steps take half again as long on AVX-512).
TILE_COMPILE = "-O3 -march=native -fopenmp -ffast-math -fPIC -c"
TILE_COMPILE += " -mprefer-vector-width=512" if platform.machine() in ("x86_64", "AMD64") else ""
TILE_LINK = "-shared -fopenmp"


def tile_library() -> Path:
    """attnlib/csrc/tiled.cpp built into the cache (once per source, compiler and CPU)."""
    found, source = compiler("cpp"), Path(__file__).parent / "csrc" / "tiled.cpp"
    if found is None:
        raise RuntimeError(compiler_missing("cpp"))
    version = subprocess.run([found, "--version"], capture_output=True, check=True).stdout
    cpuinfo = Path("/proc/cpuinfo")
    cpu = cpuinfo.read_bytes().partition(b"flags")[2][:4096] if cpuinfo.exists() else b""
    key = source.read_bytes() + version + (TILE_COMPILE + TILE_LINK).encode() + cpu

    def make(out):
        _run([found, *TILE_COMPILE.split(), str(source), "-o", f"{out}.o"])
        _run([found, *TILE_LINK.split(), f"{out}.o", "-o", str(out), "-lmvec", "-lm"])
        os.remove(f"{out}.o")

    return _cached("tiled", key, make)


@functools.lru_cache(maxsize=None)
def tile_kernels(name: str):
    """The (float32, float64) kernels NAME_f32 and NAME_f64 of tile_library(), loaded once:
    'tile_pass' (one tile's softmax steps, eq. 14.1), 'tiled_forward' (eqs. 14.1-14.2) or
    'tiled_backward' (eqs. 16.1-16.5)."""
    p, n = ctypes.c_void_p, ctypes.c_int64
    arguments = {"tile_pass": [p] * 4 + [n] * 3, "tiled_forward": [p] * 11 + [n, n, p],
                 "tiled_backward": [p] * 15 + [n, n, p]}  # fmt: skip
    if name not in arguments:
        raise ValueError(f"name must be one of {sorted(arguments)}, got {name!r}")
    loaded = ctypes.CDLL(str(tile_library()))
    kernels = getattr(loaded, f"{name}_f32"), getattr(loaded, f"{name}_f64")
    for kernel in kernels:
        kernel.argtypes, kernel.restype = arguments[name], None
    return kernels


@functools.lru_cache(maxsize=None)
def blas():
    """Addresses of the (sgemm_, dgemm_) that torch's CPU library exports, or (None, None).

    The compiled forward calls them for its matmuls; without them it runs its own loops."""
    folder = Path(torch.__file__).parent / "lib"
    for path in [*sorted(folder.glob("libtorch_cpu.*")), None]:  # None: what is loaded already
        try:
            loaded = ctypes.CDLL(None if path is None else str(path))
            return tuple(ctypes.cast(getattr(loaded, name), ctypes.c_void_p).value
                         for name in ("sgemm_", "dgemm_"))  # fmt: skip
        except (OSError, AttributeError):
            continue
    return None, None


@functools.lru_cache(maxsize=None)
def build(language="cpp", flags=None):
    """Compile attnlib/csrc/attention.{cpp,rs} with `flags` (COMMANDS' by default); load it."""
    kernel = ctypes.CDLL(str(library(language, flags))).attention
    p, n = ctypes.c_void_p, ctypes.c_int64  # pointer, int64
    kernel.argtypes, kernel.restype = [p, p, p, n, n, p, p, ctypes.c_float, n, n, n, n, p], None
    return kernel


def _rows(name, x, heads, layout):
    """x [N, heads*width] as contiguous float32 on the CPU, and its width per head."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a 2-D tensor {layout}, got {got}")
    if type(heads) is not int or heads < 1 or x.shape[1] < heads or x.shape[1] % heads:
        raise ValueError(f"{name}'s heads ({heads!r}) must be a whole number dividing its "
                         f"{x.shape[1]} features")  # fmt: skip
    return x.detach().to("cpu", torch.float32).contiguous(), x.shape[1] // heads


def _positions(name, given, length, start):
    """Positions as contiguous int64 [length]; the default is start .. start+length-1."""
    positions = torch.arange(start, start + length) if given is None else torch.as_tensor(given)
    if positions.dtype not in INTEGERS or tuple(positions.shape) != (length,):
        got = f"{positions.dtype} of shape {list(positions.shape)}"
        raise ValueError(f"{name} must be {length} integers [{length}], got {got}")
    return positions.to("cpu", torch.int64).contiguous()


def native_attention(q, k, v, q_heads, kv_heads, query_positions=None, key_positions=None,
                     scale=None, language="cpp", flags=None):  # fmt: skip
    """Eqs. 2.2, 4.1, 7.1 and 9.1 as compiled loops over one sequence (see attnlib.loops).

    q [T, Hq*D], k [S, Hkv*D], v [S, Hkv*Dv] -> float32 [T, Hq*Dv], from build(language, flags)."""
    q, dim = _rows("q", q, q_heads, "[T, Hq*D]")
    k, key_dim = _rows("k", k, kv_heads, "[S, Hkv*D]")
    if q_heads % kv_heads:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
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
