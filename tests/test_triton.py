"""The Triton kernels of chapter 17, run here by Triton's interpreter (no GPU): values against
SDPA and `tiled_attention`, gradients against autograd, the blocks they skip, L, the helpers.

The interpreter runs each program in Python and NumPy, so the shapes are small and the
hypothesis examples few."""

import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlib import causal_attention, left_padding, tiled_attention

from .references import bottom_right_mask, sdpa

ta = pytest.importorskip("attnlib.lab.triton_attention")
pytestmark = pytest.mark.skipif(
    not ta.INTERPRETED, reason="these tests run the kernels on CPU tensors, in the interpreter"
)


def _qkv(batch, q_heads, kv_heads, queries, keys, dim, value_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, queries, dim, generator=gen)
    k = torch.randn(batch, kv_heads, keys, dim, generator=gen)
    v = torch.randn(batch, kv_heads, keys, value_dim, generator=gen)
    d_out = torch.randn(batch, q_heads, queries, value_dim, generator=gen)
    return q, k, v, d_out


def _grads(attention, q, k, v, d_out, dtype):
    inputs = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    out = attention(*inputs)
    return out.detach(), torch.autograd.grad(out, inputs, d_out.to(dtype))


@settings(max_examples=20, deadline=None)
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 3]),
    queries=st.integers(1, 40),
    extra_keys=st.integers(0, 24),  # the positions offset: S - T cached keys
    dim=st.sampled_from([8, 12, 16]),
    value_dim=st.sampled_from([8, 20]),
    causal=st.booleans(),
    blocks=st.sampled_from([(16, 16), (16, 32), (32, 16)]),
    seed=st.integers(0, 2**16),
)
def test_forward_and_gradients_on_drawn_shapes(
    batch, kv_heads, group, queries, extra_keys, dim, value_dim, causal, blocks, seed
):
    keys = queries + extra_keys
    q, k, v, d_out = _qkv(batch, kv_heads * group, kv_heads, queries, keys, dim, value_dim, seed)
    block_m, block_n = blocks

    def kernel(q, k, v):
        return ta.triton_attention(q, k, v, causal=causal, block_m=block_m, block_n=block_n)

    out, grads = _grads(kernel, q, k, v, d_out, torch.float32)
    mask = None  # SDPA with the positions rule as an explicit (bottom-right) mask
    if causal:
        positions = torch.arange(keys).expand(batch, keys)
        mask = bottom_right_mask(positions[:, extra_keys:], positions)
    assert torch.allclose(out, sdpa(q, k, v, mask), atol=1e-5)
    tiled = tiled_attention(q, k, v, block_size=block_m) if causal else None
    if tiled is not None:
        assert torch.allclose(out, tiled, atol=1e-5)
    exact, expected = _grads(
        lambda q, k, v: causal_attention(q, k, v, causal=causal), q, k, v, d_out, torch.float64
    )
    assert torch.allclose(out.double(), exact, atol=1e-5)
    for mine, reference in zip(grads, expected):
        assert mine.dtype == torch.float32
        assert torch.allclose(mine.double(), reference, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_and_decode_with_explicit_positions():
    q, k, v, d_out = _qkv(2, 4, 2, 21, 50, 16, 16, seed=3)
    chunk = torch.arange(29, 50)  # the last 21 of 50 tokens, keys 0..49 cached
    out, grads = _grads(
        lambda q, k, v: ta.triton_attention(q, k, v, chunk, torch.arange(50), block_m=16),
        q, k, v, d_out, torch.float32,
    )  # fmt: skip
    exact, expected = _grads(
        lambda q, k, v: causal_attention(q, k, v, chunk, torch.arange(50)),
        q, k, v, d_out, torch.float64,
    )  # fmt: skip
    assert torch.allclose(out.double(), exact, atol=1e-5)
    for mine, reference in zip(grads, expected):
        assert torch.allclose(mine.double(), reference, atol=1e-4)
    step = ta.triton_attention(q[:, :, -1:], k, v, query_positions=[49])  # one decode query
    assert torch.allclose(step, out[:, :, -1:], atol=1e-6)


def test_left_padding_rows_that_see_no_key_are_zero_with_zero_gradients():
    q, k, v, d_out = _qkv(3, 2, 1, 20, 20, 8, 8, seed=4)
    positions, _ = left_padding([20, 5, 0], 20)  # pads sit at negative positions
    key_positions = torch.where(positions < 0, 10**6, positions)  # a pad key: never seen

    def kernel(q, k, v):
        return ta.triton_attention(q, k, v, positions, key_positions, block_m=16, block_n=16)

    out, (dq, dk, dv) = _grads(kernel, q, k, v, d_out, torch.float32)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.equal(dq[2], 0 * dq[2])
    assert torch.equal(dk[2], 0 * dk[2]) and torch.equal(dv[1, :, :15], 0 * dv[1, :, :15])
    exact, expected = _grads(
        lambda q, k, v: causal_attention(q, k, v, positions, key_positions),
        q, k, v, d_out, torch.float64,
    )  # fmt: skip
    assert torch.allclose(out.double(), exact, atol=1e-5)
    for mine, reference in zip((dq, dk, dv), expected):
        assert torch.allclose(mine.double(), reference, atol=1e-4)
    _, lse = ta.triton_attention(q, k, v, positions, key_positions, return_lse=True)
    assert bool((lse[2] == -math.inf).all()) and bool(torch.isfinite(lse[0]).all())


def test_lse_is_the_log_sum_exp_of_each_row():
    q, k, v, _ = _qkv(1, 2, 2, 30, 45, 16, 16, seed=5)
    _, lse = ta.triton_attention(q, k, v, return_lse=True, block_m=16, block_n=16)
    scores = (q.double() @ k.double().transpose(-2, -1)) / 4.0  # [1, 2, 30, 45], D = 16
    hidden = torch.arange(45) > torch.arange(15, 45)[:, None]  # eq. 7.1, queries at 15..44
    expected = torch.logsumexp(scores.masked_fill(hidden, -math.inf), -1)
    assert torch.allclose(lse.double(), expected, atol=1e-5)


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # query block 1 reads the NaN
@pytest.mark.parametrize("offset", [0, 7, 40])
def test_the_blocks_wholly_in_the_future_are_never_read(offset):
    """NaN keys and values in every key block past a query block's end change nothing there."""
    queries, keys, block = 32, 32 + offset, 16
    q, k, v, _ = _qkv(1, 1, 1, queries, keys, 16, 16, seed=6)
    qpos = torch.arange(offset, keys)[None]
    ends = ta.key_block_ends(qpos, torch.arange(keys)[None], block)  # [1, 2]
    assert ends.tolist() == [[min(keys, offset + 16), keys]]  # the brute force, by hand
    k[:, :, int(ends[0, 0]) :] = math.nan  # keys query block 0 never sees
    v[:, :, -(-int(ends[0, 0]) // block) * block :] = math.nan  # whole blocks past its end
    out = ta.triton_attention(q, k, v, block_m=block, block_n=block)
    expected = causal_attention(q, k.nan_to_num(0.0), v.nan_to_num(0.0))
    assert torch.allclose(out[:, :, :16], expected[:, :, :16], atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    start=st.integers(-5, 30),
    queries=st.integers(1, 40),
    keys=st.integers(0, 60),
    block=st.sampled_from([16, 32]),
)
def test_block_bounds_against_every_pair(start, queries, keys, block):
    qpos, kpos = torch.arange(start, start + queries)[None], torch.arange(keys)[None]
    seen = kpos[0][None, :] <= qpos[0][:, None]  # [T, S], eq. 7.1
    ends = ta.key_block_ends(qpos, kpos, block)[0].tolist()
    for n, end in enumerate(ends):
        rows = seen[n * block : (n + 1) * block]
        cols = rows.any(0).nonzero()
        assert end == (int(cols.max()) + 1 if len(cols) else 0)
    starts = ta.query_starts(qpos, kpos, block)[0].tolist()
    for n, first in enumerate(starts):
        rows = seen[:, n * block : (n + 1) * block].any(1).nonzero()
        assert first == (int(rows.min()) if len(rows) else queries)


def test_round_mantissa_against_bfloat16_and_its_bound():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(7))
    assert torch.equal(ta.round_mantissa(x, 7), x.bfloat16().float())  # both nearest-even
    relative = (ta.round_mantissa(x, 10) - x).abs() / x.abs()
    assert float(relative.max()) <= 2.0**-11 and float(relative.max()) > 2.0**-12
    assert torch.equal(ta.round_mantissa(x, 23), x)


def test_gpu_timing_on_a_cpu_prints_and_returns_none(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the timing would run")
    assert ta.gpu_timing(lengths=(1024,)) is None
    assert "No CUDA GPU here" in capsys.readouterr().out


def test_bad_arguments():
    q, k, v, _ = _qkv(1, 2, 1, 4, 4, 8, 8)
    with pytest.raises(ValueError, match="power of 2"):
        ta.triton_attention(q, k, v, block_m=24)
    with pytest.raises(ValueError, match="float64"):
        ta.triton_attention(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="precision"):
        ta.triton_attention(q, k, v, precision="fast")


def test_import_attnlib_does_not_import_triton():
    code = "import sys, attnlib, attnlib.lab; print('triton' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stdout + result.stderr


def test_the_interpreter_works_when_triton_was_imported_first():
    """torch._dynamo imports triton (without its interpreter); the module still interprets."""
    code = (
        "import torch, torch._dynamo, triton; "
        "import attnlib.lab.triton_attention as ta; from attnlib import causal_attention; "
        "q = torch.randn(1, 2, 20, 16, generator=torch.Generator().manual_seed(0)); "
        "out = ta.triton_attention(q, q, q, block_m=16, block_n=16); "
        "print(ta.INTERPRETED, torch.allclose(out, causal_attention(q, q, q), atol=1e-5))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "True True", result.stdout + result.stderr
