"""Chapters 1-5 after the third reading: the claims that reading corrected stay corrected.

Each test either recomputes a corrected claim against an independent reference (autograd, a
brute-force bound, PyTorch's own initialisation) or reads the chapters' text for what the
reading removed (an unscaled z, page machinery, NaN-blind checks).
"""

import ast
import math
import re
from pathlib import Path

import pytest
import torch

from tests.markdown_prose import cell_source, notebook_cells

ROOT = Path(__file__).resolve().parent.parent
PART_ONE = sorted((ROOT / "notebooks").glob("0[1-5]_*.ipynb"))
FOLDED = {"hide-input", "hide-cell", "remove-input", "remove-cell"}


def markdown(path) -> str:
    return "\n".join(cell_source(c) for c in notebook_cells(path) if c["cell_type"] == "markdown")


def code_cells(path) -> list:
    return [c for c in notebook_cells(path) if c["cell_type"] == "code"]


def test_part_one_is_there():
    assert [p.name[:2] for p in PART_ONE] == ["01", "02", "03", "04", "05"]


# One letter, one meaning: z is the score the softmax receives. From chapter 2 on, every
# definition of z_ij divides the dot product by sqrt(d_k) (chapter 1's scale is 1).
Z_DEFINITION = re.compile(r"z_\{ij\}\s*=\s*(.*?)(?:\$|\\tag|\\qquad|$)", re.M | re.S)


def unscaled_z_definitions(text: str) -> list:
    return [m.group(0) for m in Z_DEFINITION.finditer(text) if "sqrt" not in m.group(1)]


def test_z_is_always_the_scaled_score_from_chapter_2_on():
    for path in PART_ONE[1:]:
        found = unscaled_z_definitions(markdown(path))
        assert not found, f"{path.name} defines z_ij without the division: {found}"


def test_the_z_check_catches_the_old_equation_2_3():
    old = "$$\nz_{ij} = q_i \\cdot k_j = x_i\\, W_Q W_K^\\top\\, x_j^\\top \\tag{2.3}\n$$"
    new = "$z_{ij} = q_i \\cdot k_j / \\sqrt{d_k}$"
    assert unscaled_z_definitions(old) and not unscaled_z_definitions(new)


# Page machinery: how the page is built is no part of a chapter.
MACHINERY = [
    r"static (?:web )?page",
    r"rendered in\s+advance",
    r"drawn in\s+advance",
    r"keep the page light",
    r"machine these pages",
    r"on the day the page",
    r"#\s*Not compared",
    r"#\s*reason:",
    r"fmt:\s*skip",
]


@pytest.mark.parametrize("path", PART_ONE, ids=lambda p: p.stem)
def test_no_page_machinery(path):
    text = "\n".join(cell_source(c) for c in notebook_cells(path))
    found = [p for p in MACHINERY if re.search(p, text, re.I)]
    assert not found, f"{path.name}: {found}"


def nan_blind_asserts(code: str) -> list:
    """Lines of assert statements that call the builtin max or min: max(0.0, nan) is 0.0."""
    tree = ast.parse("\n".join(line for line in code.splitlines() if not line.startswith("%")))
    return sorted(
        {
            node.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.Assert)
            for call in ast.walk(node.test)
            if isinstance(call, ast.Call)
            and isinstance(call.func, ast.Name)
            and call.func.id in ("max", "min")
        }
    )


@pytest.mark.parametrize("path", PART_ONE, ids=lambda p: p.stem)
def test_no_assert_rests_on_the_builtin_max(path):
    for number, cell in enumerate(code_cells(path)):
        source = cell_source(cell)
        assert not nan_blind_asserts(source), f"{path.name}, code cell {number}"
        assert not re.search(r"worst\s*=\s*max\(\s*worst", source), f"{path.name} {number}"


def test_the_builtin_max_is_nan_blind_and_the_check_sees_it():
    assert max(0.0, math.nan) == 0.0  # why the check exists
    assert torch.tensor([0.0, math.nan]).max().isnan()  # what the chapters use instead
    assert nan_blind_asserts("assert max(column) - min(column) < 0.03") == [1]
    assert nan_blind_asserts("assert column.max() - column.min() < 0.03") == []


# Chapter 1: spectral radius x mean tanh slope is a rough guide to the shrink per step, not a
# formula; measured here with autograd, independently of the chapter's product of Jacobians.
def rnn(seed):
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    W = 0.9 * W / torch.linalg.matrix_norm(W, ord=2)
    U = torch.randn(8, 3, generator=gen, dtype=torch.float64)
    return W, U, torch.randn(40, 3, generator=gen, dtype=torch.float64)


def rates_by_autograd(seed):
    W, U, xs = rnn(seed)

    def state(first, t):
        h = torch.zeros(8, dtype=torch.float64)
        for x in torch.cat([first[None], xs[1:t]]):
            h = torch.tanh(W @ h + U @ x)
        return h

    def size(t):
        jac = torch.autograd.functional.jacobian(lambda first: state(first, t), xs[0])
        return torch.linalg.matrix_norm(jac, ord=2).item()

    slopes = []
    h = torch.zeros(8, dtype=torch.float64)
    for x in xs:
        h = torch.tanh(W @ h + U @ x)
        slopes.append(1 - h**2)
    radius = torch.linalg.eigvals(W).abs().max().item()
    measured = (size(40) / size(20)) ** (1 / 20)
    return measured, radius * torch.stack(slopes).mean().item()


def test_the_shrink_guess_is_a_heuristic_over_ten_seeds():
    pairs = torch.tensor([rates_by_autograd(seed) for seed in range(10)])  # [10, 2]
    gaps = (pairs[:, 0] - pairs[:, 1]).abs()
    assert not gaps.isnan().any()
    assert gaps.max() < 0.08  # what chapter 1 now claims, over seeds 0 to 9
    assert gaps[0] < 0.05 and (gaps > 0.05).sum() >= 2  # seed 0 alone hid seeds 3 and 6
    assert (pairs[:, 0] < 0.5).all()  # every one far below the bound 0.9


# Chapter 2: the checks behind "V never moves the weights" and "near 1/6" can fail.
def test_linearity_in_the_values_catches_weights_that_read_the_values():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(6, 2, generator=gen), torch.randn(6, 2, generator=gen)
    va, vb = torch.randn(6, 3, generator=gen), torch.randn(6, 3, generator=gen)

    def honest(v):
        return torch.softmax(q @ k.T, dim=-1) @ v

    def reads_values(v):  # weights that depend on v: not a layer of eq. (2.2)
        return torch.softmax(q @ k.T + v.sum(-1), dim=-1) @ v

    assert torch.allclose(honest(va + vb), honest(va) + honest(vb), atol=1e-6)
    assert not torch.allclose(reads_values(va + vb), reads_values(va) + reads_values(vb))


def test_every_weight_lies_within_e_to_the_span_of_uniform():
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(1000, 7, generator=gen, dtype=torch.float64) * 3  # [rows, L]
    a = torch.softmax(z, dim=-1)
    span = (z.max(-1).values - z.min(-1).values)[:, None]
    L = z.shape[-1]
    assert ((a <= span.exp() / L) & (a >= (-span).exp() / L)).all()
    # The bound is tight: a row of L - 1 equal scores and one s below them.
    s = 0.8
    row = torch.tensor([0.0] * (L - 1) + [-s], dtype=torch.float64)
    low = torch.softmax(row, dim=-1)[-1].item()
    assert math.exp(-s) / L < low < 1.2 * math.exp(-s) / L


# Chapter 3: PyTorch's default nn.Linear draws U(-1/sqrt(n), 1/sqrt(n)), variance 1/(3n), so
# unit-variance inputs give components of variance 1/3 and scores of variance d/9.
def test_default_linear_gives_components_of_variance_one_third():
    n = 256
    torch.manual_seed(0)
    weight = torch.nn.Linear(n, 512, bias=False).weight.double()  # [512, n]
    assert weight.abs().max() <= 1 / math.sqrt(n)
    assert abs(weight.var().item() * 3 * n - 1) < 0.02
    # Expected variance of one output component for unit-variance inputs: n Var(w) = 1/3,
    # whatever the output width; the scores' variance per unit of width is then 1/9.
    assert abs(n * weight.var().item() - 1 / 3) < 0.01
