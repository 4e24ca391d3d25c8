import json
import subprocess
import sys

import pytest
import torch

from attnlib import causal_attention, tiled_attention
from attnlib.bench import growth_exponent
from attnlib.memory import peak_allocated_bytes, peak_rss_bytes


def test_peak_allocated_bytes_is_exact():
    assert peak_allocated_bytes(lambda: torch.ones(1000, 1000)) == 4_000_000
    x = torch.randn(1000, 1000)
    assert peak_allocated_bytes(lambda: (x + 1).exp().sum()) == 8_000_000  # x+1 and its exp
    assert peak_allocated_bytes(lambda: x.sum()) < 100  # no copy of x: only a scalar


@pytest.mark.parametrize("method", [causal_attention, tiled_attention])
def test_allocator_and_operating_system_agree(method):
    # The OS's resident high-water mark sees everything, BLAS scratch space included.
    q = torch.randn(1, 2, 2048, 16)
    allocated = peak_allocated_bytes(lambda: method(q, q, q))
    resident = peak_rss_bytes(lambda: method(q, q, q))
    if method is causal_attention:  # ~100 MiB of scores: big blocks, straight from the OS
        assert abs(resident - allocated) < 0.1 * allocated
    else:  # ~1.5 MiB: small blocks may reuse freed heap, so the OS sees at most a few MiB more
        assert resident < allocated + 8 * 2**20


def test_growth_exponent_recovers_a_power_law():
    sizes = [512, 1024, 2048, 4096]
    assert growth_exponent(sizes, [3.0 * s**2 for s in sizes]) == pytest.approx(2.0)
    assert growth_exponent(sizes, [7.0 * s for s in sizes]) == pytest.approx(1.0)
    assert growth_exponent([512], [1.0]) is None


def test_import_stays_light():
    # torch itself imports tqdm, so look only at what `import attnlib` adds.
    code = (
        "import sys, torch; old = set(sys.modules); import attnlib; new = set(sys.modules) - old; "
    )
    code += "print(sorted(m for m in new if m.split('.')[0] in {'tqdm', 'matplotlib'}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "[]", result.stderr


def test_quick_bench_writes_its_report(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    command = [sys.executable, "-m", "attnlib", "bench", "--quick", "--sizes", "32", "64"]
    command += ["--repeats", "1", "--out", str(out), "--plot", str(png)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "tiled_attention" in result.stdout and "targets:" in result.stdout
    report = json.loads(out.read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["roofline"]["gflops"] > 0
    rows = {(r["method"], r["T"]): r for r in report["results"]}
    assert set(rows) == {
        (m, t) for m in ("naive", "tiled", "sdpa_mask", "sdpa_causal") for t in (32, 64)
    }
    for row in rows.values():
        assert row["max_abs_err_vs_sdpa"] < 1e-5  # every method computes the same attention
        assert row["time_vs_sdpa_causal"] > 0 and 0 < row["roofline_fraction"]
        assert len(row["times_s"]) == 1 and row["peak_bytes"] > 0
    assert rows[("sdpa_causal", 64)]["time_vs_sdpa_causal"] == 1.0
    naive = report["exponents"]["naive"]["memory"]
    assert 1.5 < naive < 2.2  # scores dominate even at T = 32..64 (a T^2 term plus small T terms)
    assert set(report["targets"]) == {
        "tiled_time_vs_sdpa",
        "tiled_memory_vs_naive",
        "naive_memory_exponent",
    }
    assert report["memory_method"].startswith("peak of PyTorch CPU allocator")
