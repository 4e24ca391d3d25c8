"""tiled_attention(..., inner="cpp"): the compiled forward equals the torch inner and SDPA.

In CI (env var CI set) a missing compiler fails these tests; elsewhere it skips them, saying why.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlib import left_padding, native, sliding_window, tiled_attention

from .references import bottom_right_mask, brute_force, sdpa


@pytest.fixture(autouse=True)
def compiler():
    missing = native.compiler_missing("cpp")
    if missing and os.environ.get("CI"):
        pytest.fail(f"CI must compile and test the fused pass: {missing}")
    if missing:
        pytest.skip(missing)


def _qkv(seed, batch, q_heads, kv_heads, queries, keys, dim, value_dim, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, queries, dim, generator=gen, dtype=dtype)
    k = torch.randn(batch, kv_heads, keys, dim, generator=gen, dtype=dtype)
    v = torch.randn(batch, kv_heads, keys, value_dim, generator=gen, dtype=dtype)
    return q, k, v


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    queries=st.integers(1, 40),
    extra=st.integers(0, 30),
    block=st.sampled_from([1, 4, 16, 64]),
    window=st.sampled_from([None, 1, 5]),
)
def test_equals_the_torch_inner_and_sdpa(seed, kv_heads, group, queries, extra, block, window):
    q, k, v = _qkv(seed, 2, kv_heads * group, kv_heads, queries, queries + extra, 8, 5)
    keys = queries + extra
    query_positions = torch.arange(extra, keys).expand(2, -1)
    key_positions = torch.arange(keys).expand(2, -1)
    allowed = None if window is None else sliding_window(query_positions, key_positions, window)
    arguments = (q, k, v, query_positions, key_positions, allowed)
    torch_inner = tiled_attention(*arguments, block_size=block)
    cpp_inner = tiled_attention(*arguments, block_size=block, inner="cpp")
    assert (cpp_inner - torch_inner).abs().max() <= 2e-6
    mask = bottom_right_mask(query_positions, key_positions)
    if allowed is not None:
        mask = mask & allowed
    assert torch.allclose(cpp_inner, sdpa(q, k, v, mask), atol=1e-5)


def test_float64_padded_batch_and_a_row_that_sees_nothing():
    q, k, v = _qkv(1, 3, 4, 2, 9, 9, 6, 6, torch.float64)
    positions, allowed = left_padding([9, 5, 0], 9)  # the last row is all pads
    got = tiled_attention(q, k, v, positions, positions, allowed, block_size=4, inner="cpp")
    expected = brute_force(q, k, v, positions, positions, allowed)
    assert got.dtype == torch.float64 and not got.isnan().any()
    assert torch.allclose(got, expected, atol=1e-12)
    assert torch.equal(got[2], torch.zeros_like(got[2]))


def test_lse_and_gradients_flow_through_the_same_function():
    q, k, v = (x.requires_grad_() for x in _qkv(2, 2, 4, 2, 12, 12, 8, 8, torch.float64))
    grad = torch.randn(2, 4, 12, 8, generator=torch.Generator().manual_seed(3), dtype=q.dtype)
    results = {}
    for inner in ("torch", "cpp"):
        out, lse = tiled_attention(q, k, v, block_size=5, return_lse=True, inner=inner)
        results[inner] = (out, lse, *torch.autograd.grad((out * grad).sum() + lse.sum(), (q, k, v)))
    for a, b in zip(results["torch"], results["cpp"]):
        assert torch.allclose(a, b, atol=1e-12)
    positions = torch.arange(12).expand(2, -1)
    reference = brute_force(*(x.detach() for x in (q, k, v)), positions, positions)
    small = [x.detach()[:1, :2, :5, :3].clone().requires_grad_() for x in (q, k, v)]
    small[1], small[2] = (
        small[1][:, :1].detach().requires_grad_(),
        small[2][:, :1].detach().requires_grad_(),
    )
    assert torch.autograd.gradcheck(
        lambda q, k, v: tiled_attention(q, k, v, block_size=2, inner="cpp"), small
    )
    assert torch.allclose(results["cpp"][0], reference, atol=1e-12)


def test_bad_input_raises_the_same_errors():
    q, k, v = _qkv(4, 1, 2, 1, 4, 4, 8, 8)
    with pytest.raises(ValueError, match="inner must be 'torch' or 'cpp'"):
        tiled_attention(q, k, v, inner="rust")
    with pytest.raises(ValueError, match="name must be one of"):
        native.tile_kernels("tiled_sideways")
    for inner in ("torch", "cpp"):
        with pytest.raises(ValueError, match="block_size"):
            tiled_attention(q, k, v, block_size=0, inner=inner)
        with pytest.raises(ValueError):
            tiled_attention(q, k[:, :, :, :4], v, inner=inner)  # head sizes differ


def test_without_a_compiler_the_message_is_native_attentions(monkeypatch):
    monkeypatch.setattr(native, "compiler", lambda language: None)
    native.tile_kernels.cache_clear()
    try:
        with pytest.raises(RuntimeError) as caught:
            tiled_attention(*_qkv(5, 1, 1, 1, 3, 3, 4, 4), inner="cpp")
        assert str(caught.value) == native.compiler_missing("cpp")
    finally:
        native.tile_kernels.cache_clear()


def test_loading_the_library_keeps_subnormals_and_links_no_fast_math():
    code = (
        "import torch; from attnlib import native; native.tile_kernels('tile_pass'); "
        "x = torch.tensor([1e-40], dtype=torch.float32) * 1.0; print(float(x[0]) > 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "True", done.stderr
    symbols = subprocess.run(["nm", str(native.tile_library())], capture_output=True, text=True)
    assert symbols.returncode == 0 and "tiled_forward_f32" in symbols.stdout
    assert "set_fast_math" not in symbols.stdout


def test_a_hidden_key_gets_exactly_zero_weight():
    """-ffast-math assumes no infinities; the masked scores are -inf, and must still give 0."""
    q, k, v = _qkv(6, 1, 1, 1, 1, 4, 4, 4)
    k[:, :, 1:] *= 0  # equal scores for keys 1-3
    allowed = torch.tensor([True, False, True, False])
    got = tiled_attention(q, k, v, allowed=allowed, inner="cpp", block_size=4)
    weights = torch.softmax((q @ k.transpose(-2, -1) / 2).masked_fill(~allowed, -math.inf), -1)
    assert torch.allclose(got, weights @ v, atol=1e-6)


def test_per_head_masks_strided_inputs_and_one_block_for_all():
    """allowed of shape [B, Hq, T, S] is read through its strides, one head at a time."""
    q, k, v = _qkv(7, 2, 6, 3, 11, 17, 8, 4)
    q, k = (x.transpose(-2, -1).contiguous().transpose(-2, -1) for x in (q, k))  # strided
    allowed = torch.rand(2, 6, 11, 17, generator=torch.Generator().manual_seed(8)) < 0.6
    allowed[0, 1, 3] = False  # a row that sees nothing
    for block in (3, 256, 10**9):  # a block far past T and S needs no block x block buffer
        got = tiled_attention(q, k, v, allowed=allowed, block_size=block, inner="cpp")
        expected = tiled_attention(q, k, v, allowed=allowed, block_size=block)
        assert (got - expected).abs().max() <= 2e-6
        assert torch.equal(got[0, 1, 3], torch.zeros(4))


def test_without_torchs_blas_its_own_loops_give_the_same_result(monkeypatch):
    q, k, v = _qkv(9, 2, 4, 2, 13, 21, 8, 6, torch.float64)
    with_blas = tiled_attention(q, k, v, block_size=4, return_lse=True, inner="cpp")
    monkeypatch.setattr(native, "blas", lambda: (None, None))
    without = tiled_attention(q, k, v, block_size=4, return_lse=True, inner="cpp")
    for a, b in zip(with_blas, without):
        assert torch.allclose(a, b, atol=1e-12)
    positions = torch.arange(8, 21).expand(2, -1), torch.arange(21).expand(2, -1)
    assert torch.allclose(without[0], brute_force(q, k, v, *positions), atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), block=st.sampled_from([1, 3, 8]))
def test_tile_states_say_exactly_whether_eq_7_1_hides_all_none_or_some(seed, block):
    from attnlib.attention import mask_of, prepare
    from attnlib.tiled import _tile_states

    gen = torch.Generator().manual_seed(seed)
    q, k, v = _qkv(seed, 2, 1, 1, 10, 14, 4, 4)
    query_positions = torch.randint(0, 14, (2, 10), generator=gen)  # any order, repeats too
    prepared = prepare(q, k, v, query_positions, torch.randperm(14, generator=gen).expand(2, -1))
    states, mask = _tile_states(prepared, block), mask_of(prepared)[:, 0]  # [B, T, S]
    for b, i, j in torch.cartesian_prod(*map(torch.arange, states.shape)).tolist():
        cells = mask[b, i * block : (i + 1) * block, j * block : (j + 1) * block]
        assert states[b, i, j] == (2 if cells.all() else 0 if not cells.any() else 1)


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    queries=st.integers(1, 20),
    extra=st.integers(0, 12),
    block=st.sampled_from([1, 3, 8, 64]),
    masked=st.sampled_from([None, "window", "per-head"]),
)
def test_the_compiled_backward_equals_autograd_of_the_reference(
    seed, kv_heads, group, queries, extra, block, masked
):
    """Eqs. 16.1-16.5 compiled: dQ, dK, dV, through O and L, equal the torch inner's backward;
    through O, float64 autograd of SDPA with an explicit mask."""
    q, k, v = _qkv(seed, 2, kv_heads * group, kv_heads, queries, queries + extra, 6, 5,
                   torch.float64)  # fmt: skip
    keys, gen = queries + extra, torch.Generator().manual_seed(seed + 1)
    query_positions, key_positions = torch.arange(extra, keys), torch.arange(keys)
    allowed = {
        None: None,
        "window": sliding_window(query_positions, key_positions, 3),
        "per-head": torch.rand(2, kv_heads * group, queries, keys, generator=gen) < 0.5,
    }[masked]
    grad = torch.randn(2, kv_heads * group, queries, 5, generator=gen, dtype=torch.float64)
    grad_lse = torch.randn(2, kv_heads * group, queries, generator=gen, dtype=torch.float64)
    grads = {}
    for inner in ("torch", "cpp"):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = tiled_attention(*inputs, allowed=allowed, block_size=block, return_lse=True,
                                   inner=inner)  # fmt: skip
        seen = lse.isfinite()  # a row that sees no key has L = -inf and no gradient through L
        loss = (out * grad).sum() + (lse.where(seen, 0) * grad_lse).sum()
        grads[inner] = torch.autograd.grad(loss, inputs)
    for a, b in zip(grads["torch"], grads["cpp"]):
        assert torch.allclose(a, b, atol=1e-12)
    if masked == "per-head":  # rows may see no key, where SDPA's gradient is not defined
        return
    mask = bottom_right_mask(query_positions.expand(2, -1), key_positions.expand(2, -1))
    mask = mask if allowed is None else mask & allowed
    calls = {
        "sdpa": lambda q, k, v: sdpa(q, k, v, mask),
        "cpp": lambda q, k, v: tiled_attention(
            q, k, v, allowed=allowed, block_size=block, inner="cpp"
        ),  # fmt: skip
    }
    by = {}
    for name, call in calls.items():
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        by[name] = torch.autograd.grad(call(*inputs), inputs, grad)
    for a, b in zip(by["sdpa"], by["cpp"]):
        assert torch.allclose(a, b, atol=1e-10)


def test_the_compiled_backward_is_deterministic_and_needs_no_blas(monkeypatch):
    q, k, v = _qkv(11, 2, 6, 2, 40, 40, 8, 8)
    grad = torch.randn(2, 6, 40, 8, generator=torch.Generator().manual_seed(12))

    def gradients():
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        return torch.autograd.grad(tiled_attention(*inputs, block_size=8, inner="cpp"), inputs,
                                   grad)  # fmt: skip

    first, second = gradients(), gradients()
    assert all(torch.equal(a, b) for a, b in zip(first, second))  # bit for bit
    monkeypatch.setattr(native, "blas", lambda: (None, None))
    for a, b in zip(first, gradients()):
        assert (a - b).abs().max() <= 1e-5


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc")
def test_the_library_shares_torchs_openmp_runtime():
    """One OpenMP runtime in the process: the compiled loops use torch's threads, not a second
    pool that would fight it for the cores."""
    code = (
        "import json, torch; from attnlib import native; native.tile_kernels('tiled_forward'); "
        "maps = open('/proc/self/maps').read().split(chr(10)); "
        "print(json.dumps(sorted({m.split()[-1] for m in maps if 'omp' in m.split('/')[-1]})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    runtimes = json.loads(done.stdout)  # the paths of the OpenMP libraries mapped
    assert len(runtimes) == 1 and "torch" in runtimes[0], runtimes
