"""Chapters 11 and 12 after the third reading: NaN-aware checks, `__restrict` at -O2, and the
flush-to-zero modes of a -ffast-math library, thread by thread.

A check that takes Python's `max` over errors passes a NaN silently whenever the NaN is not
first (`max(0.0, nan)` is 0.0); each check changed for that fails on a NaN here, the notebooks'
cells included (run on made-up inputs).
"""

import json
import math
import platform
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from attnlib import native
from attnlib.lab import compiled

ROOT = Path(__file__).resolve().parents[1]
NAN = float("nan")


def cell_source(notebook: str, cell_id: str) -> str:
    cells = json.loads((ROOT / "notebooks" / notebook).read_text())["cells"]
    (cell,) = [cell for cell in cells if cell.get("id") == cell_id]
    return "".join(cell["source"])


def need_gcc(major_at_least=0):
    missing = native.compiler_missing("cpp")
    if missing:
        pytest.skip(missing)
    version = subprocess.run(["g++", "-dumpversion"], capture_output=True, text=True)
    if int(version.stdout.split(".")[0]) < major_at_least:
        pytest.skip(f"the notes checked here are g++ {major_at_least}'s")


# The Qwen3 report (chapter 12): its largest difference and its verdict.


def test_python_max_is_nan_blind_and_largest_is_not():
    from attnlib.lab import qwen3

    assert max([0.0, NAN]) == 0.0  # the bug: a NaN after the first value is skipped
    assert math.isnan(qwen3.largest([0.0, NAN])) and math.isnan(qwen3.largest([NAN, 0.0]))
    assert math.isnan(qwen3.largest(torch.tensor([1.0, NAN, 2.0])))
    assert qwen3.largest([1e-7, 3e-7, 2e-7]) == 3e-7


@pytest.fixture(scope="module")
def small_layer():
    pytest.importorskip("transformers")
    from attnlib.lab import qwen3

    geometry = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    return qwen3.random_layer(seed=0, head_dim=16, **geometry)


@pytest.mark.parametrize("where", [0, 5])
def test_a_nan_in_any_case_fails_the_report(small_layer, monkeypatch, where):
    """NaN in the first case or in a later one: max_abs_diff is NaN and the report says no."""
    from attnlib.lab import qwen3

    def made_up(layer, seq_len, batch, seed):
        diffs = [1e-7] * 8
        diffs[where] = NAN
        pairs = iter(diffs)
        return {
            case: {
                impl: {"max_abs_diff": next(pairs), "mean_abs_diff": 1e-8, "output_scale": 3.0}
                for impl in qwen3.IMPLEMENTATIONS
            }
            for case in qwen3.CASES
        }

    monkeypatch.setattr(qwen3, "run_cases", made_up)
    result = qwen3.report(small_layer, seq_len=6, batch=1)
    assert math.isnan(result["max_abs_diff"]) and result["match"] is False
    assert "NO MATCH" in qwen3.format_report(result)


def test_a_nan_weight_fails_the_report_end_to_end(small_layer):
    import copy

    from attnlib.lab import qwen3

    broken = copy.deepcopy(small_layer)
    with torch.no_grad():
        broken.o_proj.weight[0, 0] = NAN  # output feature 0 is NaN, in both passes
    result = qwen3.report(broken, seq_len=6, batch=1)
    assert math.isnan(result["max_abs_diff"]) and result["match"] is False


def test_a_nan_output_scale_gives_no_bfloat16_tolerance():
    from attnlib.lab import qwen3

    assert math.isnan(qwen3.tolerance("bfloat16", NAN))
    assert not (1e-3 < qwen3.tolerance("bfloat16", NAN))  # so no difference is within it
    assert qwen3.tolerance("bfloat16", 3.0) == 4 * 2.0**-6


# The notebooks' checks that reduced with max or min, on made-up inputs with one NaN.


def rates_namespace(nan_at):
    """What chapter 11's claims cell reads, with made-up rates (GFLOP/s) of this CPU's kind."""
    rates = {
        "Python loops, T = S = 32": 0.05,
        "Python loops, T = S = 16": 0.045,
        "C++ loops": 5.0,
        "Rust loops": 8.0,
        "attnlib tensors": 8.5,
        "SDPA": 40.0,
    }
    if nan_at is not None:
        rates[nan_at] = NAN
    return {"rates": rates, "matmul": 100.0, "ready": ["cpp", "rust"],
            "LANGUAGES": {"cpp": "C++", "rust": "Rust"}}  # fmt: skip


def test_chapter_11_claims_cell_holds_on_plausible_rates():
    exec(cell_source("11_compiled_loops.ipynb", "06bdc6e6"), rates_namespace(None))


@pytest.mark.parametrize(
    "nan_at",
    ["Python loops, T = S = 16", "Python loops, T = S = 32", "C++ loops", "Rust loops",
     "attnlib tensors", "SDPA"],
)  # fmt: skip
def test_chapter_11_claims_cell_fails_on_a_nan_rate(nan_at):
    with pytest.raises(AssertionError):
        exec(cell_source("11_compiled_loops.ipynb", "06bdc6e6"), rates_namespace(nan_at))


def test_chapter_11_claims_cell_asserts_a_third_of_the_matmul_rate():
    namespace = rates_namespace(None)
    namespace["rates"]["Rust loops"] = 34.0  # over a third of 100 GFLOP/s
    with pytest.raises(AssertionError):
        exec(cell_source("11_compiled_loops.ipynb", "06bdc6e6"), namespace)


def float64_report(sdpa, eager):
    """A made-up float64 report: per case {impl: {max_abs_diff}}; the lists give the cases."""
    cases = {f"case {n}": {"sdpa": {"max_abs_diff": s}, "eager": {"max_abs_diff": e}}
             for n, (s, e) in enumerate(zip(sdpa, eager))}  # fmt: skip
    return {"cases": cases}


def chapter_12_float64_cell(report):
    from attnlib.lab import qwen3

    fake = SimpleNamespace(
        report=lambda *args, **kwargs: report,
        random_layer=lambda *args, **kwargs: None,
        IMPLEMENTATIONS=qwen3.IMPLEMENTATIONS,
        largest=qwen3.largest,
    )
    exec(cell_source("12_qwen3_lab.ipynb", "12c727b5"), {"qwen3": fake, "torch": torch})


def test_chapter_12_float64_cell_holds_and_fails_on_a_nan():
    chapter_12_float64_cell(float64_report([1e-15, 2e-15, 1e-15], [1e-7, 2e-7, 1e-7]))
    for sdpa, eager in [
        ([1e-15, NAN, 1e-15], [1e-7, 2e-7, 1e-7]),
        ([1e-15, 2e-15, 1e-15], [1e-7, 2e-7, NAN]),
    ]:
        with pytest.raises(AssertionError):
            chapter_12_float64_cell(float64_report(sdpa, eager))


def test_chapter_12_summation_cell_fails_on_a_nan():
    source = cell_source("12_qwen3_lab.ipynb", "92b22241")
    exec(source, {"torch": torch, "np": np})
    terms = torch.randn(1024, generator=torch.Generator().manual_seed(1))
    terms[-1] = NAN  # one NaN term: every sum, forwards or backwards, is NaN

    def randn(*args, **kwargs):
        return terms.clone()

    fake_torch = SimpleNamespace(Generator=torch.Generator, randn=randn)
    with pytest.raises(AssertionError):
        exec(source, {"torch": fake_torch, "np": np})


def test_chapters_11_and_12_reduce_no_check_with_pythons_max_or_min():
    for notebook in ("11_compiled_loops.ipynb", "12_qwen3_lab.ipynb"):
        cells = json.loads((ROOT / "notebooks" / notebook).read_text())["cells"]
        for cell in cells:
            if cell["cell_type"] == "code":
                code = "".join(cell["source"])
                assert not re.search(r"(?<![.\w])(?:max|min)\(", code), (notebook, cell["id"])


# `__restrict` at the book's -O2 (chapter 11): the overlap check goes, the loop stays scalar.


def test_restrict_pointers_keeps_the_lines_and_names_the_four_arrays():
    plain = (compiled.CSRC / "attention.cpp").read_text()
    promised = compiled.restrict_pointers()
    assert len(promised.splitlines()) == len(plain.splitlines())
    assert compiled.loop_lines(promised) == compiled.loop_lines()
    assert re.findall(r"__restrict (\w+)", promised) == ["q", "k", "v", "out"]
    with pytest.raises(ValueError, match="expected one"):
        compiled.restrict_pointers(promised)  # already promised: no plain signature left


def test_restrict_alone_does_not_vectorise_the_weighted_sum_at_o2():
    need_gcc(major_at_least=12)
    promised = compiled.restrict_pointers()
    at_o2 = compiled.gcc_loop_notes("-O2", promised)["weighted sum"]
    assert at_o2 == ["scalar", "needs a scalar tail", "not worth it"]
    dynamic = compiled.gcc_loop_notes("-O2 -fvect-cost-model=dynamic", promised)
    assert dynamic["weighted sum"] == ["16-byte vectors"]
    assert compiled.gcc_loop_notes("-O3", promised)["weighted sum"] == ["16-byte vectors"]
    plain = compiled.gcc_loop_notes("-O2")  # without the promise: the overlap check first
    assert plain["weighted sum"] == ["scalar", "would need a run-time overlap check"]
    assert "needs a scalar tail" in plain["dot product"]


# Flush-to-zero and denormals-are-zero: per thread (MXCSR), set by crtfastmath.o at load time.


@pytest.mark.skipif(platform.machine() != "x86_64", reason="MXCSR's FTZ/DAZ are x86 modes")
def test_fast_math_flushes_the_loading_thread_and_later_ones_only(tmp_path, monkeypatch):
    need_gcc()
    monkeypatch.setenv("ATTNLIB_CACHE", str(tmp_path))
    version = subprocess.run(["g++", "-dumpversion"], capture_output=True, text=True)
    flushes = float(int(version.stdout.split(".")[0]) < 13)  # crtfastmath.o before g++ 13
    fast = compiled.subnormal_by_thread(native.library("cpp", "-O3 -ffast-math -shared -fPIC"))
    assert fast == {
        "main thread, before loading": 0,
        "main thread": flushes,
        "a thread started before loading": 0,
        "a thread started after loading": flushes,
        "PyTorch's pool: main thread's half": flushes,
        "PyTorch's pool: other half": 0,
    }
    reorder = native.library("cpp", f"-O3 {compiled.REORDER} -shared -fPIC")
    assert set(compiled.subnormal_by_thread(reorder).values()) == {0}


def test_a_nan_timing_makes_the_matmul_rate_nan(monkeypatch):
    """matmul_rate keeps the best rate; a NaN among the rates must not be skipped as a loser."""
    from attnlib.lab import timing

    seconds = iter([1e-3, NAN, 1e-3, 2e-3])  # the second of four shapes times as NaN
    monkeypatch.setattr(timing, "median_seconds", lambda call, repeats: next(seconds))
    rate = timing.matmul_rate(sizes=(8, 16), repeats=1)
    assert math.isnan(rate["gflops"]) and rate["shape"] == "[1, 16, 16] @ [1, 16, 16]"
