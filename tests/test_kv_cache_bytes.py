"""The KV-cache formulas of chapter 10 against what PyTorch measures.

Eq. 10.1 against the allocator's count for a real attnlib.KVCache filled for every layer;
eq. 10.2 against torch's own FLOP counter running a real decoding step.
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from attnlib import KVCache, causal_attention
from attnlib.cost import attention_flops
from attnlib.lab.decode import kv_cache_bytes, kv_intensity, step_bytes, step_intensity
from attnlib.lab.memory import peak_allocated_bytes

LAYERS, HEAD_DIM = 28, 128  # Qwen3-0.6B


@pytest.mark.parametrize(
    "kv_heads,dtype,batch,tokens",
    [(8, torch.bfloat16, 1, 64), (1, torch.bfloat16, 2, 48), (16, torch.float32, 1, 33)],
    ids=["qwen3-gqa", "mqa-batch", "mha-float32"],
)
def test_kv_cache_bytes_equal_the_allocators_count_for_a_real_cache(kv_heads, dtype, batch, tokens):
    positions = torch.arange(tokens)  # one [S] shared by every layer, allocated before
    caches = []

    def fill():
        for _ in range(LAYERS):
            shape = (batch, kv_heads, tokens, HEAD_DIM)  # [B, Hkv, S, Dh]
            cache = KVCache()
            cache.append(torch.zeros(shape, dtype=dtype), torch.ones(shape, dtype=dtype), positions)
            caches.append(cache)

    measured = peak_allocated_bytes(fill)
    assert len(caches) == LAYERS and len(caches[-1]) == tokens
    assert measured == kv_cache_bytes(tokens, LAYERS, kv_heads, HEAD_DIM, dtype, batch)


def test_a_decoding_step_grows_the_cache_by_one_token_of_eq_10_1():
    cache, shape = KVCache(), (1, 2, 10, HEAD_DIM)
    cache.append(torch.zeros(shape), torch.zeros(shape), torch.arange(10))
    one = (1, 2, 1, HEAD_DIM)
    keys, values, _ = cache.append(torch.zeros(one), torch.zeros(one), torch.tensor([10]))
    assert keys.nbytes + values.nbytes == kv_cache_bytes(11, 1, 2, HEAD_DIM, torch.float32)
    assert kv_cache_bytes(11, 1, 2, HEAD_DIM, torch.float32) - kv_cache_bytes(
        10, 1, 2, HEAD_DIM, torch.float32
    ) == kv_cache_bytes(1, 1, 2, HEAD_DIM, torch.float32)


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
