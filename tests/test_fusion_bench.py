"""The fusion benchmark of chapter 14 (attnlib.lab.fusion): counts exact, runs end to end.

No time is asserted: the benchmark prints its findings and writes them to JSON.
"""

import json
import os

import pytest

from attnlib import native
from attnlib.lab import fusion


@pytest.fixture(autouse=True)
def compiler():
    missing = native.compiler_missing("cpp")
    if missing and os.environ.get("CI"):
        pytest.fail(f"CI must build the fused pass: {missing}")
    if missing:
        pytest.skip(missing)


def test_tile_traffic_counts_six_sweeps_against_two():
    moved = fusion.tile_traffic(rows=8 * 256, width=256)
    assert moved["tile"] == 2 * 2**20
    assert moved["torch"] == 6 * moved["tile"] and moved["fused"] == 2 * moved["tile"]
    assert fusion.tile_traffic(3, 5, itemsize=8) == {"tile": 120, "torch": 720, "fused": 240}


def test_the_benchmark_runs_and_writes_its_report(tmp_path, capsys):
    out = tmp_path / "fusion.json"
    assert fusion.main(["--lengths", "64", "128", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [row["T"] for row in report["rows"]] == [64, 128]
    assert set(report["rows"][0]) == {"T", "sdpa", "torch", "cpp"}
    assert set(report["loaded"]) == {"T", "sdpa", "torch", "cpp"} and report["loaded"]["T"] == 128
    assert "torch" in report["tile"] and "fused" in report["tile"]
    assert "x SDPA" in capsys.readouterr().out


def test_bad_arguments_stop_with_a_message():
    with pytest.raises(SystemExit):
        fusion.main(["--lengths", "0"])


def test_the_shipped_report_has_every_length_of_the_chapter():
    report = json.loads(fusion.MEASURED.read_text())
    assert [row["T"] for row in report["rows"]] == [1024, 2048, 4096, 8192, 16384]
    assert report["window"]["window"] == 256 and report["machine"]["processor"]
