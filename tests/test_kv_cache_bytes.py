"""The KV-cache formulas of chapter 10 against what PyTorch measures.

Eq. 10.1 against the allocator's count of what real caches keep: attnlib.KVCache filled by a
real MultiHeadAttention layer, and transformers' DynamicCache filled by a real Qwen3 layer;
eq. 10.2 against torch's own FLOP counter running a real decoding step.
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from attnlib import KVCache, MultiHeadAttention, causal_attention
from attnlib.cost import attention_flops
from attnlib.lab.decode import kv_cache_bytes, kv_intensity, step_bytes, step_intensity
from attnlib.lab.memory import held_allocated_bytes

LAYERS, HEAD_DIM = 28, 128  # Qwen3-0.6B


def _decoding_layer(q_heads, kv_heads, dtype, layers=LAYERS, d_in=32):
    """A real MultiHeadAttention of head size HEAD_DIM and one KVCache per layer: the caches are
    filled by attnlib's own code, not by tensors shaped here to match the formula."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(d_in, q_heads * HEAD_DIM, q_heads=q_heads, kv_heads=kv_heads)
    layer = layer.to(dtype)
    caches = [KVCache() for _ in range(layers)]

    def run(x):  # x [B, T, d_in] in `dtype`: every layer's cache takes its keys and values
        with torch.no_grad():
            for cache in caches:
                layer(x, cache)

    return run, caches


@pytest.mark.parametrize(
    "q_heads,kv_heads,dtype,batch,prompt",
    [(16, 8, torch.bfloat16, 1, 24), (4, 1, torch.bfloat16, 2, 16), (2, 2, torch.float32, 1, 9)],
    ids=["qwen3-gqa", "mqa-batch", "mha-float32"],
)
def test_the_allocator_counts_eq_10_1_in_caches_a_real_layer_filled(
    q_heads, kv_heads, dtype, batch, prompt
):
    run, caches = _decoding_layer(q_heads, kv_heads, dtype, layers=4)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, prompt + 1, 32, generator=gen).to(dtype)
    after_prompt = held_allocated_bytes(lambda: run(x[:, :prompt]))
    after_step = after_prompt + held_allocated_bytes(lambda: run(x[:, prompt:]))
    positions = 8 * 4  # int64 positions [S] in each of the 4 caches, per token
    tokens = prompt + 1
    assert all(len(cache) == tokens for cache in caches)
    assert after_step == kv_cache_bytes(tokens, 4, kv_heads, HEAD_DIM, dtype, batch) + (
        positions * tokens
    )
    # After the prompt the cache holds views of the fused projection [B, T, (Hq + 2Hkv) Dh]:
    # the whole of it stays alive, queries included, until the first step copies K and V out.
    itemsize = torch.empty((), dtype=dtype).element_size()
    projection = 4 * batch * prompt * (q_heads + 2 * kv_heads) * HEAD_DIM * itemsize
    assert after_prompt == projection + positions * prompt
    assert after_prompt > kv_cache_bytes(prompt, 4, kv_heads, HEAD_DIM, dtype, batch)


def test_each_later_decoding_step_adds_one_token_of_eq_10_1():
    run, caches = _decoding_layer(16, 8, torch.bfloat16, layers=LAYERS)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 13, 32, generator=gen).bfloat16()  # [B, T, d_in]
    # A prompt, then one step: from here on the caches are K and V alone. Measured as well,
    # since the allocator reports the size of a free only for memory allocated while measuring.
    held_allocated_bytes(lambda: run(x[:, :10]))
    held_allocated_bytes(lambda: run(x[:, 10:11]))
    grown = [held_allocated_bytes(lambda t=t: run(x[:, t : t + 1])) for t in (11, 12)]
    one_token = kv_cache_bytes(1, LAYERS, 8, HEAD_DIM)  # bfloat16
    assert grown == [one_token + 8 * LAYERS] * 2  # and one int64 position per layer
    assert len(caches[0]) == 13


def test_transformers_dynamic_cache_of_a_real_qwen3_layer_holds_eq_10_1():
    transformers = pytest.importorskip("transformers")
    from attnlib.lab import qwen3

    layer = qwen3.random_layer(seed=0)  # Qwen3-0.6B's attention: 16 query, 8 KV heads of 128
    batch, prompt = 2, 12
    x = torch.randn(batch, prompt + 1, 1024, generator=torch.Generator().manual_seed(1))
    cos, sin = qwen3.hf_cos_sin(layer, x, torch.arange(prompt + 1).expand(batch, prompt + 1))
    cache = transformers.DynamicCache()

    def run(start, stop):
        mask = qwen3.causal_mask(batch, stop - start, stop, torch.float32)
        part = slice(start, stop)
        qwen3.layer_forward(layer, x[:, part], cos[:, part], sin[:, part], mask, cache)

    after_prompt = held_allocated_bytes(lambda: run(0, prompt))
    assert after_prompt == kv_cache_bytes(prompt, 1, 8, HEAD_DIM, torch.float32, batch)
    after_step = after_prompt + held_allocated_bytes(lambda: run(prompt, prompt + 1))
    assert after_step == kv_cache_bytes(prompt + 1, 1, 8, HEAD_DIM, torch.float32, batch)


@pytest.mark.parametrize("q_heads,kv_heads", [(16, 16), (16, 4), (16, 1), (6, 2)])
@pytest.mark.parametrize("queries", [1, 3])
def test_kv_intensity_is_torchs_flop_count_over_the_bytes_of_k_and_v(q_heads, kv_heads, queries):
    keys, dim = 40, 16
    gen = torch.Generator().manual_seed(q_heads * kv_heads + queries)
    q = torch.randn(1, q_heads, queries, dim, generator=gen)  # [B, Hq, T, D]
    k = torch.randn(1, kv_heads, keys, dim, generator=gen).bfloat16()  # [B, Hkv, S, D]
    v = torch.randn(1, kv_heads, keys, dim, generator=gen).bfloat16()
    with FlopCounterMode(display=False) as counter:
        causal_attention(q, k.float(), v.float(), query_positions=torch.full((queries,), keys))
    expected = counter.get_total_flops() / (k.nbytes + v.nbytes)  # the cache is bfloat16
    assert kv_intensity(queries, keys, dim, q_heads, kv_heads) == pytest.approx(expected)
    # (2T / itemsize)(Hq / Hkv) with itemsize 2: T * Hq / Hkv FLOPs per byte
    assert kv_intensity(queries, keys, dim, q_heads, kv_heads) == queries * q_heads / kv_heads


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: kv_cache_bytes(-1, 1, 1, 1), "tokens must be an integer of at least 0"),
        (lambda: kv_cache_bytes(8, 0, 1, 1), "layers must be an integer of at least 1"),
        (lambda: kv_cache_bytes(8, 1, 2.0, 1), "kv_heads must be an integer"),
        (lambda: kv_cache_bytes(8, 1, 1, 1, batch=0), "batch must be an integer of at least 1"),
        (lambda: kv_intensity(1, 8, 4, 6, 4), r"query heads \(6\) must be a multiple of KV heads"),
        (lambda: kv_intensity(1, 0, 4, 4, 4), "keys must be an integer of at least 1"),
    ],
    ids=["tokens", "layers", "kv_heads", "batch", "groups", "no keys"],
)
def test_bad_arguments_say_what_to_fix(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("q_heads,kv_heads", [(16, 16), (16, 4), (16, 1)])
@pytest.mark.parametrize("queries,keys", [(1, 40), (5, 40), (12, 12)])
def test_step_bytes_are_the_tensors_a_step_reads_and_writes(q_heads, kv_heads, queries, keys):
    dim = 16
    q = torch.zeros(1, q_heads, queries, dim)  # [B, Hq, T, D]
    k = torch.zeros(1, kv_heads, keys, dim)  # [B, Hkv, S, D]
    out = causal_attention(q, k, k)  # O: [B, Hq, T, D]
    counted = step_bytes(queries, keys, dim, q_heads, kv_heads, torch.float32)
    assert counted == {"K": k.nbytes, "V": k.nbytes, "Q": q.nbytes, "O": out.nbytes}
    flops = attention_flops(queries, keys, dim, heads=q_heads)
    full = step_intensity(queries, keys, dim, q_heads, kv_heads, torch.float32)
    assert full == pytest.approx(flops / (2 * k.nbytes + 2 * q.nbytes))
    # eq. 10.2: 2 T S Hq / (b (T Hq + S Hkv)), below the K-and-V-only count
    expected = 2 * queries * keys * q_heads / (4 * (queries * q_heads + keys * kv_heads))
    assert full == pytest.approx(expected)
    assert full < kv_intensity(queries, keys, dim, q_heads, kv_heads, torch.float32)


def test_causal_prefill_counts_about_half_the_pairs():
    every = step_intensity(4096, 4096, 128, 16, 16, torch.float32)
    causal = step_intensity(4096, 4096, 128, 16, 16, torch.float32, causal=True)
    assert causal / every == pytest.approx(4097 / (2 * 4096))


def test_step_bytes_refuses_groups_that_do_not_divide():
    with pytest.raises(ValueError, match="must be a multiple"):
        step_bytes(1, 8, 4, 6, 4)
