"""Traffic between slow and fast memory: FlashAttention's central argument, counted.

Dao et al. (2022), Theorem 2: for N queries and keys of width d, standard attention moves
Theta(N d + N^2) elements between slow memory (a GPU's HBM, a CPU's RAM) and fast memory (SRAM,
caches), because it writes the N x N scores and weights out and reads them back. Tiled attention
whose tiles fit a fast memory of M elements (d <= M <= N d) moves Theta(N^2 d^2 / M): it never
writes the scores, but reads Q and O (or K and V) once per block of the other side.

The counts below follow the paper's algorithms line by line, per head, in elements:
- `naive_traffic`: Algorithm 0 reads Q, K (2Nd), writes Z and reads it (2N^2), writes the weights
  and reads them (2N^2) with V (Nd), writes O (Nd): 4Nd + 4N^2.
- `tiled_traffic`: Algorithm 1 with B_c = ceil(M / 4d) keys and B_r = min(B_c, d) queries per
  tile; K and V are read once (2Nd); for each of the T_c = ceil(N / B_c) key blocks, every Q_i,
  O_i, l_i, m_i is read and O_i, l_i, m_i written: T_c (3Nd + 4N).
`cache_sizes` reads this machine's caches from Linux's sysfs, the candidates for M on a CPU.
"""

import glob
import math
import os


def _positive(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def naive_traffic(length: int, dim: int) -> int:
    """Elements standard attention moves to and from slow memory (Dao et al. 2022, Alg. 0)."""
    _positive("length", length), _positive("dim", dim)
    return 4 * length * dim + 4 * length**2


def tile_sizes(dim: int, fast_elements: int) -> tuple:
    """(B_r, B_c): queries and keys per tile for a fast memory of `fast_elements` (Alg. 1)."""
    _positive("dim", dim), _positive("fast_elements", fast_elements)
    if fast_elements < 4 * dim:
        raise ValueError(f"a fast memory of {fast_elements} elements cannot hold 4 rows of {dim}")
    keys = math.ceil(fast_elements / (4 * dim))
    return min(keys, dim), keys


def tiled_traffic(length: int, dim: int, fast_elements: int) -> int:
    """Elements tiled attention moves to and from slow memory (Dao et al. 2022, Alg. 1)."""
    _positive("length", length)
    _, keys = tile_sizes(dim, fast_elements)
    key_blocks = math.ceil(length / keys)  # T_c
    return 2 * length * dim + key_blocks * (3 * length * dim + 4 * length)


def cache_sizes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> list:
    """[(level, type, bytes)] of the data and unified caches Linux reports for cpu0, or []."""
    found = []
    for index in sorted(glob.glob(os.path.join(root, "index*"))):
        try:
            with open(os.path.join(index, "level")) as f:
                level = int(f.read())
            with open(os.path.join(index, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(index, "size")) as f:
                size = f.read().strip()
        except (OSError, ValueError):
            continue
        if kind == "Instruction":
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        number = int(size.rstrip("KMG")) * units.get(size[-1], 1)
        found.append((level, kind, number))
    return sorted(found)
