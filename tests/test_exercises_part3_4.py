"""Chapters 11 to 15: the checked exercise that parts III and IV added, and the two diagnoses.

Beyond the generic tests (tests/test_exercises.py, tests/test_answers.py): the sliding window's
FLOP count of exercise 13.3 is the count of the masks of chapter 7, its three named mistakes are
named when a reader writes them in their own way, right answers in several styles pass, and the
diagnosis cells of chapters 12 and 14 sit in the sections their bugs point to, visible, with the
verdict that names the bug stored under them.
"""

import json
import math
from pathlib import Path

import pytest
import torch

import attnlib
from attnlib.lab.exercises import BUGS, EXERCISES, check
from tests.test_exercises import assert_bugs_differ

REPO = Path(__file__).resolve().parent.parent

# ---- exercise 13.3: readers' answers ----------------------------------------------------------


def mask_count(queries, keys, window):
    """Pairs allowed by the library's masks: eq. 7.1 and a window, queries the last of keys."""
    query_pos, key_pos = torch.arange(keys - queries, keys), torch.arange(keys)
    causal = attnlib.visible(query_pos[None], key_pos[None])[0, 0]  # [T, S]
    return int((causal & attnlib.sliding_window(query_pos, key_pos, window)).sum())


def flops_by_masks(queries, keys, head_dim, window):
    return 4 * head_dim * mask_count(queries, keys, window)


def flops_closed_form(queries, keys, head_dim, window):
    def triangle(n):
        return max(n, 0) * (max(n, 0) + 1) // 2

    pairs = queries * keys - queries * (queries - 1) // 2
    pairs -= triangle(keys - window) - triangle(keys - queries - window)
    return 4 * head_dim * pairs


def flops_by_rows(queries, keys, head_dim, window):
    """Full rows of w keys, then the first w - 1 positions counted apart, as a float."""
    first = keys - queries  # the first query's position
    short = range(first, min(window - 1, keys))  # positions with fewer than w keys behind
    pairs = (queries - len(short)) * window + sum(p + 1 for p in short)
    return float(4 * head_dim * pairs)


def flops_everyone_gets_w(queries, keys, head_dim, window):
    return 4 * head_dim * queries * window


def flops_distance_up_to_w(queries, keys, head_dim, window):
    query_pos, key_pos = torch.arange(keys - queries, keys), torch.arange(keys)
    back = query_pos[:, None] - key_pos[None, :]
    return 4 * head_dim * int(((back >= 0) & (back <= window)).sum())


def flops_causal_only(queries, keys, head_dim, window):
    return attnlib.attention_flops(queries, keys, head_dim, causal=True)


def flops_window_without_causal(queries, keys, head_dim, window):  # not in the bank
    return 4 * head_dim * queries * min(window, keys)


PLANTED = {
    "window_flops_full_width": flops_everyone_gets_w,
    "window_flops_one_too_wide": flops_distance_up_to_w,
    "window_flops_no_window": flops_causal_only,
}
RIGHT = [flops_by_masks, flops_closed_form, flops_by_rows]


@pytest.mark.parametrize("keys", range(1, 25))
def test_the_reference_counts_the_pairs_of_the_masks(keys):
    reference = EXERCISES["window_flops"].reference
    for queries in range(1, keys + 1):
        for window in range(1, keys + 3):
            expected = 4 * 3 * mask_count(queries, keys, window)
            assert reference(queries, keys, 3, window) == expected, (queries, keys, window)
            assert flops_closed_form(queries, keys, 3, window) == expected


def test_the_window_reaches_the_library_counts_at_its_ends():
    reference = EXERCISES["window_flops"].reference
    for queries, keys in ((1, 9), (5, 5), (7, 20)):
        causal = attnlib.attention_flops(queries, keys, 16, causal=True)
        assert reference(queries, keys, 16, keys) == causal  # w = S hides nothing
        assert reference(queries, keys, 16, 1) == 4 * 16 * queries  # w = 1: its own key


def test_the_cases_run_from_a_decoding_query_to_a_window_wider_than_the_sequence():
    args = [case.args for case in EXERCISES["window_flops"].cases()]
    assert any(t == 1 for t, s, d, w in args)
    assert any(t < s and s - t < w < s for t, s, d, w in args)  # some queries see < w keys
    assert any(w > s for t, s, d, w in args) and any(w == 1 for t, s, d, w in args)
    assert all(t <= s for t, s, d, w in args)


@pytest.mark.parametrize("bug", PLANTED)
def test_a_planted_bug_is_named_and_points_to_its_section(bug, capsys):
    result = check("window_flops", PLANTED[bug])
    assert not result.passed and result.diagnosis == bug, result.text
    assert result.section == BUGS[bug].section
    assert (result.section.chapter, result.section.number) == ("07_positions", "7.5")
    assert str(result.section) in " ".join(result.text.split())
    assert "First failing case" in result.text and "Tolerance" in result.text


@pytest.mark.parametrize("fn", RIGHT, ids=lambda fn: fn.__name__)
def test_a_right_answer_passes_in_every_style(fn, capsys):
    result = check("window_flops", fn)
    assert result.passed and result.diagnosis is None, result.text


def test_an_unknown_mistake_gets_no_name(capsys):
    result = check("window_flops", flops_window_without_causal)
    assert not result.passed and result.diagnosis is None, result.text


def test_the_new_bugs_differ_from_the_reference_and_from_each_other():
    assert_bugs_differ("window_flops", PLANTED)


# ---- the diagnoses of parts III and IV --------------------------------------------------------


def diagnosis_cell(bug: str):
    """(the heading above it, the cell) of the notebook cell asserting `bug`'s diagnosis."""
    section = BUGS[bug].section
    cells = json.loads((REPO / "notebooks" / f"{section.chapter}.ipynb").read_text())["cells"]
    heading, fence = None, False
    for cell in cells:
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            for line in text.splitlines():
                fence ^= line.startswith("```")
                if line.startswith("## ") and not fence:
                    heading = line[3:]
        elif f'result.diagnosis == "{bug}"' in text:
            return heading, cell
    pytest.fail(f"no cell of {section.chapter} asserts the diagnosis {bug}")


def shown(cell) -> str:
    return "".join(
        "".join(o.get("data", {}).get("text/plain", "")) + "".join(o.get("text", ""))
        for o in cell["outputs"]
    )


@pytest.mark.parametrize(
    "bug, exercise",
    [("rmsnorm_over_all_heads", "qk_norm"), ("online_sum_not_rescaled", "online_softmax")],
)
def test_each_part_shows_its_diagnosis_in_the_section_of_its_bug(bug, exercise):
    heading, cell = diagnosis_cell(bug)
    section = BUGS[bug].section
    assert heading == section.title
    assert f'check("{exercise}"' in "".join(cell["source"])
    assert not any("hide" in tag or "remove" in tag for tag in cell["metadata"].get("tags", []))
    assert len(cell["source"]) <= 12, "a few visible lines"
    text = shown(cell)
    assert text.startswith(f"{exercise}: not yet"), text
    assert f"`{bug}`" in text and str(section) in " ".join(text.split())


def test_the_wrong_functions_of_the_diagnoses_are_named_here_too(capsys):
    """The same mistakes, written afresh: a mean over all heads, and l never rescaled."""

    def norm_over_all_heads(x, weight, eps):
        return x * torch.rsqrt(x.pow(2).mean((-2, -1), keepdim=True) + eps) * weight

    def sum_not_rescaled(scores, values, block):
        best = torch.full((scores.shape[0], 1), -math.inf, dtype=scores.dtype)
        total = torch.zeros_like(best)
        out = torch.zeros(scores.shape[0], values.shape[1], dtype=scores.dtype)
        for start in range(0, scores.shape[1], block):
            s = scores[:, start : start + block]
            new_best = torch.maximum(best, s.amax(-1, keepdim=True))
            shift = new_best.nan_to_num(neginf=0.0)
            weights = torch.exp(s - shift)
            total = total + weights.sum(-1, keepdim=True)
            out = torch.exp(best - shift) * out + weights @ values[start : start + block]
            best = new_best
        return out / torch.where(total > 0, total, 1.0)

    assert check("qk_norm", norm_over_all_heads).diagnosis == "rmsnorm_over_all_heads"
    assert check("online_softmax", sum_not_rescaled).diagnosis == "online_sum_not_rescaled"


# ---- exercise 15.1: the tiles a block mask lists ----------------------------------------------


def rule(query_positions, key_positions, window, reach=0, pads=True):
    q, k = query_positions[:, None], key_positions[None, :]
    seen = (k <= q) & (q - k < window + reach)
    return seen & (k >= 0) if pads else seen


def counts_by_tiles(visible, block, partial_only=False):
    listed = full = 0
    for i in range(0, visible.shape[0], block):
        for j in range(0, visible.shape[1], block):
            tile = visible[i : i + block, j : j + block]
            listed += int(tile.any() and not (partial_only and tile.all()))
            full += int(tile.all())
    return listed, full


def counts_loops(query_positions, key_positions, block, window):
    return counts_by_tiles(rule(query_positions, key_positions, window), block)


def counts_padded_reshape(query_positions, key_positions, block, window):
    """Pad the grid to whole tiles (False for `any`, True for `all`) and reduce per tile."""
    visible = rule(query_positions, key_positions, window)
    t, s = visible.shape
    rows, cols = -(-t // block) * block, -(-s // block) * block

    def tiles(fill):
        grid = torch.full((rows, cols), fill)
        grid[:t, :s] = visible
        return grid.reshape(rows // block, block, cols // block, block).transpose(1, 2)

    listed = tiles(False).flatten(2).any(-1)
    full = tiles(True).flatten(2).all(-1)
    return torch.tensor(float(listed.sum())), torch.tensor(float(full.sum()))


def counts_one_too_wide(query_positions, key_positions, block, window):
    return counts_by_tiles(rule(query_positions, key_positions, window, reach=1), block)


def counts_pads_seen(query_positions, key_positions, block, window):
    return counts_by_tiles(rule(query_positions, key_positions, window, pads=False), block)


def counts_partial_only(query_positions, key_positions, block, window):
    visible = rule(query_positions, key_positions, window)
    return counts_by_tiles(visible, block, partial_only=True)


def counts_without_causal(query_positions, key_positions, block, window):  # not in the bank
    q, k = query_positions[:, None], key_positions[None, :]
    return counts_by_tiles((k >= 0) & ((q - k).abs() < window), block)


PLANTED_ALSO = [
    ("block_window_one_too_wide", "block_counts", counts_one_too_wide),
    ("block_pads_visible", "block_counts", counts_pads_seen),
    ("block_listed_without_full", "block_counts", counts_partial_only),
]


@pytest.mark.parametrize("bug, exercise, wrong", PLANTED_ALSO, ids=[b for b, _, _ in PLANTED_ALSO])
def test_a_planted_block_count_bug_is_named(bug, exercise, wrong, capsys):
    result = check(exercise, wrong)
    assert not result.passed and result.diagnosis == bug, result.text
    assert result.section == BUGS[bug].section
    assert (result.section.chapter, result.section.number) == ("15_flex_windows_fusion", "15.2")


@pytest.mark.parametrize("fn", [counts_loops, counts_padded_reshape], ids=lambda fn: fn.__name__)
def test_a_right_block_count_passes(fn, capsys):
    result = check("block_counts", fn)
    assert result.passed and result.diagnosis is None, result.text


def test_an_unknown_block_count_mistake_gets_no_name(capsys):
    result = check("block_counts", counts_without_causal)
    assert not result.passed and result.diagnosis is None, result.text


@pytest.mark.parametrize("lengths, window", [([256, 256], 512), ([384, 200], 100), ([384, 50], 7)])
def test_the_block_count_reference_is_flexattentions_block_mask(lengths, window):
    """At FlexAttention's tiles of 128, the reference counts what create_block_mask lists."""
    from attnlib.lab import flex

    key_pos, _ = attnlib.left_padding(lengths, total=max(lengths))
    query_pos = key_pos[:, -128:]
    mask = flex.positions_block_mask(query_pos, key_pos, window=window)
    reference = EXERCISES["block_counts"].reference
    for row in range(len(lengths)):
        listed, full = reference(query_pos[row], key_pos[row], 128, window)
        assert full == int(mask.full_kv_num_blocks[row].sum())
        assert listed == full + int(mask.kv_num_blocks[row].sum())
