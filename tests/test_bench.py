import json
import subprocess
import sys

import pytest
import torch

from attnlib import causal_attention, tiled_attention
from attnlib.lab.memory import peak_allocated_bytes, peak_rss_bytes


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


def test_quick_bench_writes_its_report(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    command = [sys.executable, "-m", "attnlib", "bench", "--quick", "--sizes", "32", "64"]
    command += ["--repeats", "1", "--out", str(out), "--plot", str(png)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "tiled_attention" in result.stdout and "growth exponents" in result.stdout
    report = json.loads(out.read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = {(r["method"], r["T"]): r for r in report["results"]}
    assert set(rows) == {
        (m, t) for m in ("naive", "tiled", "sdpa_mask", "sdpa_causal") for t in (32, 64)
    }
    for row in rows.values():
        assert row["max_abs_err_vs_sdpa"] < 1e-5  # every method computes the same attention
    naive = report["exponents"]["naive"]["memory"]
    assert 1.5 < naive < 2.2  # scores dominate even at T = 32..64 (a T^2 term plus small T terms)


def test_bad_bench_options_are_one_line_and_exit_2():
    command = [sys.executable, "-m", "attnlib", "bench", "--quick", "--heads", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == "error: --heads must be at least 1, got 0\n"
