"""Chapters 1 to 5: what part I's new exercises need beyond the generic tests.

Beyond tests/test_exercises.py and tests/test_answers.py: the prefix-LM exercise (5.4) names
each of its two bugs when a reader writes it in their own way, passes right answers in several
styles, leaves an unknown mistake unnamed (the v = identity probe finds the leak), and its
reference is causal attention at P = 0 and attention with no mask at P = T; the prediction of
exercise 4.3 holds on other seeds, not just the answer's; exercise 3.2 calls its variance the
pooled one; and chapter 5's diagnosis cell sits in its section with its verdict stored.
"""

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import attnlib
from attnlib.lab.exercises import BUGS, EXERCISES, check
from tests.test_exercises import assert_bugs_differ

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"

# ---- readers' answers to exercise 5.4 -----------------------------------------------------------


def prompt_rule(t, prefix):
    """[T, T] True where query i reads key j: j <= i or j < P."""
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    return (j <= i) | (j < prefix)


def prefix_masked_fill(q, k, v, prefix, rule=prompt_rule):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~rule(q.shape[2], prefix), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def prefix_sdpa(q, k, v, prefix):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=prompt_rule(q.shape[2], prefix))


def prefix_attnlib(q, k, v, prefix):  # the rule as `allowed`, with the positions rule off
    return attnlib.causal_attention(q, k, v, allowed=prompt_rule(q.shape[2], prefix), causal=False)


def prefix_loops(q, k, v, prefix):
    out = torch.zeros_like(q, dtype=torch.float64)
    for i in range(q.shape[2]):
        keys = list(range(max(i + 1, prefix)))  # the prompt, and the causal past
        scores = q[:, :, i : i + 1].double() @ k[:, :, keys].double().transpose(-2, -1)
        weights = torch.softmax(scores / math.sqrt(q.shape[-1]), dim=-1)
        out[:, :, i : i + 1] = weights @ v[:, :, keys].double()
    return out


def prefix_two_blocks(q, k, v, prefix):  # the prompt block, then the causal rows below it
    t = q.shape[2]
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    mask[:prefix, :prefix] = True
    scores = torch.einsum("bhid,bhjd->bhij", q, k) * q.shape[-1] ** -0.5
    return scores.masked_fill(~mask, -math.inf).softmax(-1) @ v


PLANTED = {
    "prefix_left_causal": lambda q, k, v, p: prefix_sdpa(q, k, v, 0),
    "prefix_sees_suffix": lambda q, k, v, p: prefix_masked_fill(
        q, k, v, p, rule=lambda t, n: prompt_rule(t, 0) | (torch.arange(t)[:, None] < n)
    ),
}
RIGHT = [prefix_masked_fill, prefix_sdpa, prefix_attnlib, prefix_loops, prefix_two_blocks]


@pytest.mark.parametrize("bug", PLANTED)
def test_a_planted_bug_is_named_and_points_to_a_section_of_chapter_5(bug, capsys):
    result = check("prefix_lm_attention", PLANTED[bug])
    assert not result.passed and result.diagnosis == bug, result.text
    assert result.section == BUGS[bug].section
    assert result.section.chapter == "05_causal_masking"
    assert not result.section.title.startswith("Exercise")
    assert str(result.section) in " ".join(result.text.split())
    assert "First failing case" in result.text and "Tolerance" in result.text


@pytest.mark.parametrize("fn", RIGHT, ids=lambda f: f.__name__)
def test_a_right_answer_passes_in_every_style(fn, capsys):
    result = check("prefix_lm_attention", fn)
    assert result.passed and result.diagnosis is None, result.text


def test_the_cases_hold_the_two_ends_and_a_key_past_the_prompt():
    cases = EXERCISES["prefix_lm_attention"].cases()
    prefixes = {(c.args[0].shape[2], c.args[3]) for c in cases}
    assert any(p == 0 for _, p in prefixes) and any(p == t for t, p in prefixes)
    assert any(0 < p < t - 1 for t, p in prefixes)
    spike = [c for c in cases if "outscores" in c.label]
    assert spike and spike[0].args[3] < spike[0].args[0].shape[2] - 1  # its key is past P


def test_the_reference_is_causal_at_p_0_and_unmasked_at_p_t():
    ex = EXERCISES["prefix_lm_attention"]
    for case in ex.cases():
        q, k, v, _ = (x.double() if torch.is_tensor(x) else x for x in case.args)
        t = q.shape[2]
        assert torch.allclose(ex.reference(q, k, v, 0), attnlib.causal_attention(q, k, v))
        unmasked = attnlib.causal_attention(q, k, v, causal=False)
        assert torch.allclose(ex.reference(q, k, v, t), unmasked)


def test_the_two_bugs_differ_from_the_reference_and_from_each_other():
    assert_bugs_differ("prefix_lm_attention", PLANTED)


def test_an_unknown_mistake_gets_no_name_and_the_probe_finds_the_leak(capsys):
    # One prompt key too many (j <= P): not a bug the bank knows.
    result = check("prefix_lm_attention", lambda q, k, v, p: prefix_masked_fill(q, k, v, p + 1))
    assert not result.passed and result.diagnosis is None
    assert "must not see" in " ".join(result.text.split())


# ---- exercise 4.3's prediction, on other seeds --------------------------------------------------


@pytest.mark.parametrize("seed", range(1, 6))
def test_the_within_row_variance_is_predicted_on_any_seed(seed):
    """The answer's asserts, on seeds it does not use: the margins are not one seed's luck."""
    d, mu = 64, 0.5
    g = torch.Generator().manual_seed(seed)
    q = mu + torch.randn(1024, d, generator=g, dtype=torch.float64)
    k = mu + torch.randn(4096, d, generator=g, dtype=torch.float64)
    z = q @ k.T
    pooled = z.var(correction=0).item()
    within = z.var(dim=-1, correction=0).mean().item()
    between = z.mean(dim=-1).var(correction=0).item()
    assert abs(within + between - pooled) < 1e-9 * pooled
    assert abs(pooled / (d * (1 + 2 * mu**2)) - 1) < 0.02
    assert abs(within / (d * (1 + mu**2)) - 1) < 0.02
    assert abs(between / (d * mu**2) - 1) < 0.1


# ---- the notebooks -------------------------------------------------------------------------------


def cells(stem):
    return json.loads((NOTEBOOKS / f"{stem}.ipynb").read_text())["cells"]


def source(cell):
    return "".join(cell["source"])


def exercise_markdown(stem, number):
    """The markdown of exercise `number`, from its heading to the next exercise's."""
    found, text = False, []
    for cell in cells(stem):
        body = source(cell)
        if body.startswith("### Exercise "):
            found = body.startswith(f"### Exercise {number}:")
        if found and cell["cell_type"] == "markdown":
            text.append(body)
    return "\n".join(text)


def test_exercise_3_2_calls_its_variance_the_pooled_one_and_links_no_later_chapter():
    answer = exercise_markdown("03_scaling", "3.2").split("<details>", 1)[1]
    assert "pooled" in answer and "chapter 4" in answer
    assert not re.search(r"\]\((?:0[4-9]|[1-2]\d)_", answer)


def test_exercise_4_3_measures_the_pooled_and_the_within_row_variance():
    text = exercise_markdown("04_softmax_jacobian", "4.3")
    assert "### Exercise 4.3: the variance the softmax sees" in text
    for number in ("95.8", "79.7", "16.1", "1.25", "1.5"):
        assert number in text


def test_no_later_chapter_already_builds_a_prefix_lm_mask():
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        if int(path.name[:2]) > 5:
            text = path.read_text().lower()
            assert "prefix_lm" not in text and "prefix language model" not in text, path.name


def test_the_diagnosis_of_part_1_sits_in_its_section_with_its_verdict():
    """Chapter 5's section on masking after the softmax checks that bug and shows its name."""
    section = BUGS["mask_after_softmax"].section
    heading = None
    for cell in cells(section.chapter):
        text = source(cell)
        if cell["cell_type"] == "markdown" and text.startswith("## "):
            heading = text.splitlines()[0][3:]
        if cell["cell_type"] == "code" and 'result.diagnosis == "mask_after_softmax"' in text:
            assert heading == section.title
            assert 'check("causal_attention"' in text
            assert not set(cell["metadata"].get("tags", [])) & {"hide-cell", "hide-input"}
            assert len(text.splitlines()) <= 12
            shown = "".join(
                "".join(o.get("data", {}).get("text/plain", "")) + "".join(o.get("text", ""))
                for o in cell["outputs"]
            )
            assert shown.startswith("causal_attention: not yet")
            assert "`mask_after_softmax`" in shown and str(section) in " ".join(shown.split())
            return
    pytest.fail("no cell of chapter 5 checks the mask after the softmax")
