"""The fusion benchmark of chapter 15 (attnlib.lab.fusion): counts exact, runs end to end.

No time is asserted: the benchmark prints its findings and writes them to JSON.
"""

import json
import math
import os

import pytest
import torch

from attnlib import native
from attnlib.lab import cli, fusion


@pytest.fixture(autouse=True)
def compiler():
    missing = native.compiler_missing("cpp")
    if missing and os.environ.get("CI"):
        pytest.fail(f"CI must build the fused pass: {missing}")
    if missing:
        pytest.skip(missing)


def test_tile_traffic_counts_eight_tile_sweeps_against_the_k_and_v_blocks():
    moved = fusion.tile_traffic(rows=256, width=256, dim=64)
    assert moved["tile"] == 256 * 2**10 and moved["torch"] == 8 * moved["tile"]
    assert moved["fused"] == 2 * 256 * 64 * 4 and moved["flops"] == 2 * (2 * 256 * 256 * 64)
    assert fusion.tile_traffic(3, 5, 2, itemsize=8) == {
        "tile": 120,
        "torch": 960,
        "fused": 160,
        "flops": 120,
    }


def test_the_fused_pass_does_what_the_four_sweeps_do():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(1, 1, 6, 9, generator=gen, dtype=torch.float64)
    scores[0, 0, 2, :4] = -math.inf
    states = []
    for step in ("torch", "fused"):
        s, m = scores.clone(), torch.full((1, 1, 6, 1), -1e300, dtype=torch.float64)
        ell = torch.full((1, 1, 6, 1), 2.0, dtype=torch.float64)
        if step == "torch":
            fusion._torch_passes(s, m, ell)
            m = torch.maximum(m, scores.amax(-1, keepdim=True))
        else:
            fusion._fused_step(native.tile_kernels("tile_pass")[1], s, m, ell)
        states.append((s, m, ell))
    for a, b in zip(*states):
        assert torch.allclose(a, b, atol=1e-12)


def test_the_benchmark_runs_and_writes_its_report(tmp_path, capsys):
    out = tmp_path / "fusion.json"
    assert fusion.main(["--lengths", "64", "128", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [row["T"] for row in report["rows"]] == [64, 128]
    assert set(report["rows"][0]) == {"T", "sdpa", "torch", "cpp"}
    assert set(report["loaded"]) == {"T", "sdpa", "torch", "cpp"} and report["loaded"]["T"] == 128
    assert set(report["train"]) == {"T", "sdpa", "torch", "cpp"} and report["train"]["T"] == 128
    assert set(report["tile"]) == {"amax", "sub_", "exp2_", "sum", "fused"}
    assert "x SDPA" in capsys.readouterr().out


def test_bad_arguments_stop_with_a_message(capsys):
    assert fusion.main(["--lengths", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err
    assert cli.main(["bench-fusion", "--repeats", "0"]) == 2


def test_the_shipped_report_has_every_length_of_the_chapter():
    report = json.loads(fusion.MEASURED.read_text())
    assert [row["T"] for row in report["rows"]] == [1024, 2048, 4096, 8192, 16384]
    assert report["window"]["window"] == 256 and report["machine"]["processor"]
    assert report["train"]["T"] == report["loaded"]["T"] == 4096
