"""Chapters 6 to 10: the checked exercises that part II added, and the part's diagnosis.

Beyond the generic tests (tests/test_exercises.py, tests/test_answers.py): each new bug is
named when a reader writes it in their own way, right answers in several styles pass, a wrong
answer the bank does not know gets no name, the 8.4 dtype trap gets one line naming the reader's
line, and the diagnosis cell of chapter 9 is in its section with its verdict stored.
"""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnlib.lab.exercises import BUGS, EXERCISES, check
from tests.test_exercises import assert_bugs_differ

REPO = Path(__file__).resolve().parent.parent
NEW = ("window_attention", "pool_kv_heads", "head_contributions")

# ---- readers' answers ---------------------------------------------------------------------


def window_mask(t, s, window, wide=0, future=False, top_left=False):
    """[T, S] True where query i (at position s - t + i, or i if top_left) reads key j."""
    rows = torch.arange(t) if top_left else torch.arange(s - t, s)
    back = rows[:, None] - torch.arange(s)[None, :]
    inside = back <= window - 1 + wide
    return inside if future else inside & (back >= 0)


def window_masked_fill(q, k, v, window, **kw):
    mask = window_mask(q.shape[2], k.shape[2], window, **kw)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def window_sdpa(q, k, v, window):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=window_mask(q.shape[2], k.shape[2], window)
    )


def window_loops(q, k, v, window):
    out = torch.zeros_like(q, dtype=torch.float64)
    t, s = q.shape[2], k.shape[2]
    for i in range(t):
        p = s - t + i  # the query's position
        keys = list(range(max(0, p - window + 1), p + 1))
        w = torch.softmax(
            q[:, :, i : i + 1].double()
            @ k[:, :, keys].double().transpose(-2, -1)
            / math.sqrt(q.shape[-1]),
            -1,
        )
        out[:, :, i : i + 1] = w @ v[:, :, keys].double()
    return out


def window_causal_only(q, k, v, window):  # forgets the window: not a bug the bank names
    return window_masked_fill(q, k, v, 10**6)


def pool_reshape(k, v, kv_heads):
    b, h, s, d = k.shape
    return tuple(x.reshape(b, kv_heads, h // kv_heads, s, d).mean(2) for x in (k, v))


def pool_loop(k, v, kv_heads):
    g = k.shape[1] // kv_heads
    return tuple(
        torch.stack([x[:, j * g : (j + 1) * g].mean(1) for j in range(kv_heads)], 1) for x in (k, v)
    )


def pool_unflatten(k, v, kv_heads):
    return [x.double().unflatten(1, (kv_heads, -1)).mean(2) for x in (k, v)]


def pool_strided(k, v, kv_heads):  # heads g, g + Hkv, ...
    return tuple(
        torch.stack([x[:, j::kv_heads].mean(1) for j in range(kv_heads)], 1) for x in (k, v)
    )


def pool_summed(k, v, kv_heads):
    return tuple(x.unflatten(1, (kv_heads, -1)).sum(2) for x in (k, v))


def pool_first_head(k, v, kv_heads):  # selects instead of pooling: not named
    g = k.shape[1] // kv_heads
    return k[:, ::g], v[:, ::g]


PLANTED = {
    "window_one_too_wide": (
        "window_attention",
        lambda q, k, v, w: window_masked_fill(q, k, v, w, wide=1),
    ),
    "window_one_too_narrow": (
        "window_attention",
        lambda q, k, v, w: window_masked_fill(q, k, v, w, wide=-1),
    ),
    "window_sees_future": (
        "window_attention",
        lambda q, k, v, w: window_masked_fill(q, k, v, w, future=True),
    ),
    "top_left_mask": (
        "window_attention",
        lambda q, k, v, w: window_masked_fill(q, k, v, w, top_left=True),
    ),
    "pool_kv_strided": ("pool_kv_heads", pool_strided),
    "pool_kv_summed": ("pool_kv_heads", pool_summed),
}

RIGHT = {
    "window_attention": [window_masked_fill, window_sdpa, window_loops],
    "pool_kv_heads": [pool_reshape, pool_loop, pool_unflatten],
}


@pytest.mark.parametrize("bug", PLANTED)
def test_a_planted_bug_is_named_and_points_to_its_section(bug, capsys):
    name, wrong = PLANTED[bug]
    result = check(name, wrong)
    assert not result.passed and result.diagnosis == bug, result.text
    assert result.section == BUGS[bug].section
    assert str(result.section) in " ".join(result.text.split())
    assert not result.section.title.startswith("Exercise")
    assert "First failing case" in result.text and "Tolerance" in result.text


@pytest.mark.parametrize(
    "name, fn", [(name, fn) for name, fns in RIGHT.items() for fn in fns], ids=lambda x: str(x)
)
def test_a_right_answer_passes_in_every_style(name, fn, capsys):
    result = check(name, fn)
    assert result.passed, result.text


@pytest.mark.parametrize("name", NEW)
def test_the_new_bugs_differ_from_the_reference_and_from_each_other(name):
    assert_bugs_differ(name, EXERCISES[name].bugs)


def test_the_window_reference_is_the_library_and_the_template_agrees():
    from attnlib.lab.exercises.ch07 import _windowed

    ex = EXERCISES["window_attention"]
    for case in ex.cases():
        assert torch.allclose(ex.reference(*case.args), _windowed(*case.args))


def test_an_unknown_mistake_gets_no_name_and_the_probe_finds_the_leak(capsys):
    result = check("window_attention", window_causal_only)
    assert not result.passed and result.diagnosis is None
    assert "must not see" in " ".join(
        result.text.split()
    )  # the v = identity probe: a key outside the window
    result = check("pool_kv_heads", pool_first_head)
    assert not result.passed and result.diagnosis is None


def test_a_pooled_answer_must_be_a_pair(capsys):
    result = check("pool_kv_heads", lambda k, v, n: pool_reshape(k, v, n)[0])
    assert not result.passed and "tuple of 2" in result.message


def test_the_rope_dtype_trap_names_the_exception_and_the_line(capsys):
    """Exercise 8.4: a float64 my_rope against a float32 v raises in `weights @ v`."""

    def my_rope(x, positions):  # float64 angles, never cast back
        d = x.shape[-1]
        theta = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        a = positions[:, None].double() * theta
        a = torch.cat((a, a), -1)
        turned = torch.cat((-x[..., d // 2 :], x[..., : d // 2]), -1)
        return x * a.cos() + turned * a.sin()

    def my_rope_attention(q, k, v, positions):
        q, k = my_rope(q, positions), my_rope(k, positions)
        t = q.shape[2]
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(future, -1e30)
        weights = torch.softmax(scores, dim=-1)
        return weights @ v

    result = check("rope_attention", my_rope_attention)
    assert not result.passed and result.diagnosis is None
    assert "RuntimeError" in result.message and "`return weights @ v`" in result.message
    assert "Traceback" not in result.text


def test_rope_on_v_points_to_the_section_that_shows_it():
    section = BUGS["rope_on_v"].section
    assert (section.chapter, section.number) == ("08_rotary_positions", "8.10")
    cells = json.loads((REPO / "notebooks" / f"{section.chapter}.ipynb").read_text())["cells"]
    text = ["".join(c["source"]) for c in cells]
    start = next(i for i, t in enumerate(text) if t.startswith(f"## {section.title}"))
    end = next(i for i in range(start + 1, len(text)) if text[i].startswith("## "))
    shown = [t for t in text[start:end] if "apply_rope(v" in t and "assert same != turn_v" in t]
    assert shown, "the section turns the values and shows the outputs move"


def test_the_diagnosis_of_part_2_sits_in_its_section_with_its_verdict():
    """Chapter 9's section on repeating the heads checks the tiled layout and shows the name."""
    cells = json.loads((REPO / "notebooks" / "09_grouped_query.ipynb").read_text())["cells"]
    section = BUGS["repeat_not_interleave"].section
    heading = None
    for cell in cells:
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and text.startswith("## "):
            heading = text.splitlines()[0][3:]
        if cell["cell_type"] == "code" and 'result.diagnosis == "repeat_not_interleave"' in text:
            assert heading == section.title
            assert 'check("grouped_query_attention"' in text and ".repeat(" in text
            assert "hide" not in " ".join(cell["metadata"].get("tags", []))
            shown = "".join(
                "".join(o.get("data", {}).get("text/plain", "")) + "".join(o.get("text", ""))
                for o in cell["outputs"]
            )
            assert shown.startswith("grouped_query_attention: not yet")
            assert "`repeat_not_interleave`" in shown and str(section) in " ".join(shown.split())
            return
    pytest.fail("no cell of chapter 9 checks the tiled layout")
