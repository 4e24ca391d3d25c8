import json
import subprocess
import sys

import pytest
import torch

from attnlib import causal_attention, tiled_attention
from attnlib.lab import bench
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
    forward = ("naive", "tiled", "sdpa_mask", "sdpa_causal")
    training = ("naive_train", "tiled_train", "sdpa_train")
    assert set(rows) == {(m, t) for m in forward + training for t in (32, 64)}
    for row in rows.values():
        assert row["max_abs_err_vs_sdpa"] < 1e-5  # the same attention, the same dQ, dK, dV
    naive = report["exponents"]["naive"]["memory"]
    assert 1.5 < naive < 2.2  # scores dominate even at T = 32..64 (a T^2 term plus small T terms)
    assert "forward + backward" in result.stdout
    assert rows[("naive_train", 64)]["peak_vs_naive"] == 1
    assert 1.5 < report["exponents"]["naive_train"]["memory"] < 2.2  # autograd keeps [T, S]


def test_naive_training_step_beyond_naive_max_gets_memory_but_no_time():
    settings = {"heads": 2, "dim": 8, "repeats": 1, "block_size": 16, "seed": 0, "naive_max": 16}
    rows = bench.training_rows(16, settings) + bench.training_rows(32, settings)
    exponents = bench.summarise(rows, settings, {"gflops": 1.0})
    by = {(r["method"], r["T"]): r for r in rows}
    assert by[("naive_train", 32)]["median_s"] is None
    assert by[("naive_train", 32)]["peak_bytes_one_head"] > 0  # measured with one head
    assert by[("tiled_train", 32)]["peak_vs_naive"] > 0
    assert exponents["naive_train"]["time"] is None  # one timed size: no fit
    lines = [line for line in bench.table(rows, exponents).splitlines() if "autograd" in line]
    assert lines[1].split()[-4] == "-" and lines[1].split()[-1] == "-"  # T = 32: not timed


def test_bad_bench_options_are_one_line_and_exit_2():
    command = [sys.executable, "-m", "attnlib", "bench", "--quick", "--heads", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == "error: --heads must be at least 1, got 0\n"
