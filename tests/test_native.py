"""The compiled loops (attnlib.native: C++ and Rust) against attnlib's tensor version.

In CI (env var CI set) a missing compiler fails these tests; elsewhere it skips them, saying why.
"""

import os
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnlib
from attnlib import native
from attnlib.lab import compiled
from attnlib.native import native_attention

LANGUAGES = ["cpp", "rust"]


def need(language):
    missing = native.compiler_missing(language)
    if missing and os.environ.get("CI"):
        pytest.fail(f"CI must compile and test the {language} loops: {missing}")
    if missing:
        pytest.skip(missing)


def tensor_version(
    q, k, v, q_heads, kv_heads, query_positions=None, key_positions=None, scale=None
):
    """attnlib.causal_attention on one sequence: rows [L, H*D] -> [1, H, L, D] and back."""
    q, k, v = (
        attnlib.split_heads(x[None], h) for x, h in ((q, q_heads), (k, kv_heads), (v, kv_heads))
    )
    out = attnlib.causal_attention(q, k, v, query_positions, key_positions, scale=scale)
    return attnlib.merge_heads(out)[0]  # [T, Hq*Dv]


@st.composite
def attention_case(draw):
    kv_heads = draw(st.integers(1, 3))
    q_heads = kv_heads * draw(st.integers(1, 4))  # GQA groups of 1..4
    keys = draw(st.integers(1, 12))
    queries = draw(st.integers(1, keys))  # T <= S
    dim, value_dim = draw(st.integers(1, 16)), draw(st.integers(1, 16))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(queries, q_heads * dim, generator=generator)  # [T, Hq*D]
    k = torch.randn(keys, kv_heads * dim, generator=generator)  # [S, Hkv*D]
    v = torch.randn(keys, kv_heads * value_dim, generator=generator)  # [S, Hkv*Dv]
    # Explicit positions, in any order; a query below every key position sees nothing.
    query_positions = draw(
        st.none() | st.lists(st.integers(-4, 14), min_size=queries, max_size=queries)
    )
    key_positions = draw(st.none() | st.lists(st.integers(0, 14), min_size=keys, max_size=keys))
    scale = draw(st.none() | st.floats(0.05, 3.0))
    return q, k, v, q_heads, kv_heads, query_positions, key_positions, scale


@pytest.mark.parametrize("language", LANGUAGES)
@settings(max_examples=60, deadline=None)
@given(case=attention_case())
def test_compiled_loops_equal_the_tensor_version(language, case):
    need(language)
    out = native_attention(*case, language=language)
    expected = tensor_version(*case)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("language", LANGUAGES)
def test_a_query_that_sees_no_key_outputs_zeros(language):
    need(language)
    q, k, v = torch.ones(2, 4), torch.ones(3, 4), torch.ones(3, 6)  # Hq = Hkv = 2
    out = native_attention(q, k, v, 2, 2, [-1, 5], [0, 1, 2], language=language)
    assert torch.equal(out[0], torch.zeros(6)) and torch.allclose(out[1], torch.ones(6))
    empty = native_attention(q[:0], k[:0], v[:0], 2, 2, language=language)  # T = S = 0
    assert empty.shape == (0, 6)


Q, K, V = torch.zeros(3, 8), torch.zeros(5, 4), torch.zeros(5, 6)  # Hq = 2, Hkv = 1: D = 4
BAD = [
    (dict(q=torch.zeros(1, 3, 8)), "q must be a 2-D tensor [T, Hq*D], got [1, 3, 8]"),
    (dict(k=[[0.0] * 4] * 5), "k must be a 2-D tensor [S, Hkv*D], got list"),
    (dict(q=torch.zeros(3, 7)), "q's heads (2) must be a whole number dividing its 7 features"),
    (dict(kv_heads=0), "k's heads (0) must be a whole number dividing its 4 features"),
    (dict(kv_heads=True), "k's heads (True) must be a whole number"),
    (
        dict(q=torch.zeros(3, 12), k=torch.zeros(5, 8), q_heads=6, kv_heads=4),
        "query heads (6) must be a multiple of KV heads (4)",
    ),
    (dict(v=torch.zeros(4, 6)), "k has 5 rows (keys) but v has 4"),
    (dict(k=torch.zeros(5, 2)), "head size of q (4) must equal that of k (2)"),
    (dict(query_positions=[0, 1]), "query_positions must be 3 integers [3], got torch.int64 of"),
    (
        dict(key_positions=[0.0, 1, 2, 3, 4]),
        "key_positions must be 5 integers [5], got torch.float",
    ),
    (dict(key_positions=[[0, 1, 2, 3, 4]]), "got torch.int64 of shape [1, 5]"),
    (dict(scale=0.0), "scale must be a finite positive number, got 0.0"),
    (dict(scale=float("nan")), "scale must be a finite positive number, got nan"),
    (dict(scale="1"), "scale must be a number, got str"),
    (dict(language="java"), "language must be 'cpp' or 'rust', got 'java'"),
]


@pytest.mark.parametrize("change, message", BAD, ids=[", ".join(c) for c, _ in BAD])
def test_bad_input_is_a_clear_value_error(change, message):
    arguments = {**dict(q=Q, k=K, v=V, q_heads=2, kv_heads=1, language="cpp"), **change}
    with pytest.raises(ValueError, match=re.escape(message)):
        native_attention(**arguments)


@pytest.mark.parametrize("language", LANGUAGES)
def test_a_second_build_loads_the_cached_library(language, tmp_path, monkeypatch):
    need(language)
    monkeypatch.setenv("ATTNLIB_CACHE", str(tmp_path))
    commands, run = [], subprocess.run
    monkeypatch.setattr(
        native.subprocess, "run", lambda c, **kw: commands.append(c) or run(c, **kw)
    )
    native.build.cache_clear()
    try:
        native.build(language)
        [library] = tmp_path.glob("*.so")
        built = library.stat().st_mtime_ns
        native.build.cache_clear()  # forget the loaded library, as a new call would
        native.build(language)
        assert [c[-1] for c in commands if "-o" in c] == [
            str(tmp_path / f"{library.name}.{os.getpid()}.tmp")
        ]
        again = "from attnlib import native; native.build(%r)" % language  # a new process
        run(
            [sys.executable, "-c", again],
            check=True,
            env={**os.environ, "ATTNLIB_CACHE": str(tmp_path)},
        )
        assert list(tmp_path.iterdir()) == [library] and library.stat().st_mtime_ns == built
    finally:
        native.build.cache_clear()


def test_other_flags_build_a_second_library_with_the_same_numbers(tmp_path, monkeypatch):
    """-O3 vectorises the weighted sum (chapter 11) without reordering a sum: same bits."""
    need("cpp")
    monkeypatch.setenv("ATTNLIB_CACHE", str(tmp_path))
    native.build.cache_clear()
    try:
        generator = torch.Generator().manual_seed(0)
        q = torch.randn(5, 2 * 4, generator=generator)  # [T, Hq*D]: 2 query heads of 4
        k, v = torch.randn(2, 7, 4, generator=generator)  # [S, Hkv*D]: 1 KV head
        default = native_attention(q, k, v, 2, 1)
        other = native_attention(q, k, v, 2, 1, flags="-O3 -shared -fPIC")
        assert torch.equal(default, other)
        assert len(list(tmp_path.glob("*.so"))) == 2  # the flags are part of the cache key
        torch.testing.assert_close(default, tensor_version(q, k, v, 2, 1), atol=1e-5, rtol=0)
    finally:
        native.build.cache_clear()


def test_the_reorder_build_spreads_the_dot_product_over_the_lanes():
    """compiled.REORDER is the permission the dot product's sum needs (chapter 11)."""
    need("cpp")
    version = subprocess.run(["g++", "-dumpversion"], capture_output=True, text=True)
    if int(version.stdout.split(".")[0]) < 12:
        pytest.skip("the notes checked here are g++ 12's")
    assert compiled.gcc_loop_notes("-O3")["dot product"][:2] == [
        "16-byte vectors",
        "sum in source order",
    ]
    reordered = compiled.gcc_loop_notes(f"-O3 {compiled.REORDER}")
    assert "sum spread over the lanes" in reordered["dot product"]
    assert compiled.gcc_loop_notes("-O2")["weighted sum"] == [
        "scalar",
        "would need a run-time overlap check",
    ]


def test_the_reorder_build_is_close_but_not_bit_equal(tmp_path, monkeypatch):
    need("cpp")
    monkeypatch.setenv("ATTNLIB_CACHE", str(tmp_path))
    native.build.cache_clear()
    try:
        generator = torch.Generator().manual_seed(0)
        q = torch.randn(64, 2 * 64, generator=generator)  # [T, Hq*D]
        k, v = torch.randn(2, 64, 64, generator=generator)  # [S, Hkv*D]: 1 KV head
        default = native_attention(q, k, v, 2, 1)
        reordered = native_attention(q, k, v, 2, 1, flags=f"-O3 {compiled.REORDER} -shared -fPIC")
        assert not torch.equal(default, reordered)
        torch.testing.assert_close(default, reordered, atol=1e-5, rtol=0)
    finally:
        native.build.cache_clear()


def test_axpy_takes_the_overlap_check_away_from_the_rust_weighted_sum():
    """rustc marks reference parameters noalias: in `axpy` the loop needs no run-time check;
    written inline in `attention`'s body, it does."""
    need("rust")
    notes = compiled.rust_loop_notes()
    assert notes == {"dot product": ["scalar"], "weighted sum": ["16-byte vectors"]}
    book = (compiled.CSRC / "attention.rs").read_text()
    loop = "for (o, x) in row.iter_mut().zip(value) { *o += weight * x; }"
    inline = book.replace("axpy(row, value, weight);", loop)
    assert inline != book
    assert compiled.rust_loop_notes(inline)["weighted sum"] == [
        "16-byte vectors",
        "overlap checked at run time",
    ]


@pytest.mark.skipif(
    __import__("platform").machine() != "x86_64", reason="MXCSR's FTZ/DAZ are x86 modes"
)
def test_only_fast_math_flushes_subnormals_in_the_loading_process(tmp_path, monkeypatch):
    need("cpp")
    monkeypatch.setenv("ATTNLIB_CACHE", str(tmp_path))
    reorder = native.library("cpp", f"-O3 {compiled.REORDER} -shared -fPIC")
    before, after = compiled.subnormal_product(reorder)
    assert before == after != 0  # the subnormal survives
    version = subprocess.run(["g++", "-dumpversion"], capture_output=True, text=True)
    fast = native.library("cpp", "-O3 -ffast-math -shared -fPIC")
    before, after = compiled.subnormal_product(fast)
    assert before != 0
    assert (after == 0) == (int(version.stdout.split(".")[0]) < 13)  # crtfastmath.o


def test_build_seconds_leaves_the_cache_alone(tmp_path, monkeypatch):
    need("cpp")
    monkeypatch.setenv("ATTNLIB_CACHE", str(tmp_path))
    first, cached = compiled.build_seconds("cpp")
    assert 0 < cached < first
    assert list(tmp_path.iterdir()) == []  # built in a temporary cache of its own
