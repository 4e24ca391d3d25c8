"""The third reading's fixes in part IV (chapters 14 to 16): the cache level past which eq. 15.1's
count of bytes holds, the gain of the fused softmax steps read from a timing, and the claims the
chapters now make about them."""

import json
from pathlib import Path

import pytest

from attnlib.lab import fusion

REPO = Path(__file__).resolve().parent.parent
KIB, MIB = 2**10, 2**20


def test_levels_between_names_the_cache_that_holds_one_heads_tile_only():
    caches = [(1, "Data", 48 * KIB), (1, "Instruction", 32 * KIB), (2, "Unified", MIB)]
    caches.append((3, "Unified", 32 * MIB))
    assert fusion.levels_between(caches, 256 * KIB, 2 * MIB) == [(2, "Unified", MIB)]


def test_a_cache_exactly_the_size_of_the_swept_tile_is_too_small_to_keep_it_and_more():
    caches = [(1, "Data", 48 * KIB), (2, "Unified", 2 * MIB), (3, "Unified", 105 * MIB)]
    assert fusion.levels_between(caches, 256 * KIB, 2 * MIB) == [(2, "Unified", 2 * MIB)]
    assert fusion.levels_between(caches, 256 * KIB, 2 * MIB - 1) == []


def test_no_level_and_instruction_caches_are_not_counted():
    assert fusion.levels_between([(1, "Instruction", MIB)], 256 * KIB, 2 * MIB) == []
    assert fusion.levels_between([], 256 * KIB, 2 * MIB) == []


@pytest.mark.parametrize("kept, swept", [(0, 1), (2 * MIB, 256 * KIB), (MIB, MIB)])
def test_levels_between_refuses_sizes_in_the_wrong_order(kept, swept):
    with pytest.raises(ValueError, match="must be positive and below swept"):
        fusion.levels_between([], kept, swept)


def test_tile_gain_is_four_sweeps_over_the_compiled_pass():
    seconds = {"amax": 1.0, "sub_": 2.0, "exp2_": 3.0, "sum": 4.0, "fused": 5.0}
    assert fusion.tile_gain(seconds) == 2.0
    assert fusion.tile_gain({**seconds, "fused": float("nan")}) != 2.0  # NaN is not hidden


def test_the_shipped_reports_tile_gain_is_what_chapter_15_states():
    report = json.loads(fusion.MEASURED.read_text())
    assert f"{fusion.tile_gain(report['tile']):.2f}" == "1.50"
    cells = json.loads((REPO / "notebooks" / "15_flex_windows_fusion.ipynb").read_text())["cells"]
    prose = " ".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    assert "1.50 times as fast" in " ".join(prose.split())


def test_the_tiles_of_eq_15_1_are_the_sizes_the_level_is_sought_between():
    torch_tile = fusion.tile_traffic(8 * 256, 256, 64)
    head_tile = fusion.tile_traffic(256, 256, 64)
    assert (head_tile["tile"], torch_tile["tile"]) == (256 * KIB, 2 * MIB)
    ratio = (torch_tile["torch"] / torch_tile["flops"]) / (head_tile["fused"] / head_tile["flops"])
    assert ratio == 4 * 256 / 64 == 16  # eq. 15.1: 4t/D


def test_linear_attention_in_chapter_14_carries_its_normaliser():
    cells = json.loads((REPO / "notebooks" / "14_tiling.ipynb").read_text())["cells"]
    prose = " ".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    assert r"\big/ \psi(q_i)^\top\sum_j \psi(k_j)" in prose
