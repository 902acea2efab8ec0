"""Paged attention backends (chapter 08): TorchBackend against dense attention on random paged layouts, padding rows,
Attention binding, backend selection; FlashBackend against TorchBackend on a CUDA GPU."""
import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import nanoengine.layers.paged_attention as pa
from nanoengine.layers.attention import Attention
from nanoengine.layers.paged_attention import (FLASH_BLOCK_MULTIPLE, FlashBackend, TorchBackend, flash_attn_available,
                                               flash_unavailable_reason, get_attention_backend, key_slots)
from nanoengine.utils.context import Context, reset_context, set_context

HAS_FLASH_GPU = torch.cuda.is_available() and flash_attn_available()


def slot_of(table, pos, block_size):
    return table[pos // block_size] * block_size + pos % block_size


def make_step(specs, *, decode=False, block_size=4, num_kv_heads=2, group=2, head_dim=8, num_pad=0, spare_blocks=2,
              dtype=torch.float32, seed=0):
    """A random paged step. specs: (num_cached, num_new) per sequence. Unwritten pool rows hold NaN."""
    g = torch.Generator().manual_seed(seed)
    lengths = [c + n for c, n in specs]
    num_blocks = sum(math.ceil(n / block_size) for n in lengths) + spare_blocks
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in lengths:
        need = math.ceil(n / block_size)
        tables.append(order[:need])
        order = order[need:]
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype) for n in lengths]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype) for n in lengths]
    queries = [torch.randn(n, num_kv_heads * group, head_dim, generator=g).to(dtype) for _, n in specs]
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    for table, (c, _), kk, vv in zip(tables, specs, keys, values):
        rows = [slot_of(table, p, block_size) for p in range(c)]
        k_cache.view(-1, num_kv_heads, head_dim)[rows] = kk[:c]
        v_cache.view(-1, num_kv_heads, head_dim)[rows] = vv[:c]
    slots = [slot_of(t, p, block_size) for t, (c, n) in zip(tables, specs) for p in range(c, c + n)]
    q = torch.cat(queries)
    k = torch.cat([kk[c:] for kk, (c, _) in zip(keys, specs)])
    v = torch.cat([vv[c:] for vv, (c, _) in zip(values, specs)])
    width = max(len(t) for t in tables)
    padded = [t + [-1] * (width - len(t)) for t in tables]
    if decode:
        assert all(n == 1 for _, n in specs)
        for i in range(num_pad):
            padded.append([-1] * width if i % 2 == 0 else list(padded[0]))
            slots.append(-1)
            lengths.append(0)
        q = torch.cat([q, torch.randn(num_pad, *q.shape[1:], generator=g).to(dtype)])
        k = torch.cat([k, torch.randn(num_pad, *k.shape[1:], generator=g).to(dtype)])
        v = torch.cat([v, torch.randn(num_pad, *v.shape[1:], generator=g).to(dtype)])
        ctx = Context(is_prefill=False, slot_mapping=torch.tensor(slots, dtype=torch.int32),
                      context_lens=torch.tensor(lengths, dtype=torch.int32),
                      block_tables=torch.tensor(padded, dtype=torch.int32))
    else:
        has_cache = any(c > 0 for c, _ in specs)
        ctx = Context(is_prefill=True,
                      cu_seqlens_q=torch.tensor([0, *itertools.accumulate(n for _, n in specs)], dtype=torch.int32),
                      cu_seqlens_k=torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32),
                      max_seqlen_q=max(n for _, n in specs), max_seqlen_k=max(lengths),
                      slot_mapping=torch.tensor(slots, dtype=torch.int32),
                      block_tables=torch.tensor(padded, dtype=torch.int32) if has_cache else None)
    return SimpleNamespace(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, ctx=ctx, tables=tables, keys=keys,
                           values=values, queries=queries, block_size=block_size, num_pad=num_pad,
                           scale=head_dim ** -0.5)


def dense_attention(step):
    """Each sequence's new queries over its full K/V, causal mask aligned bottom-right, float64; padding rows zero."""
    outs = []
    for qs, ks, vs in zip(step.queries, step.keys, step.values):
        group = qs.shape[1] // ks.shape[1]
        kh = ks.transpose(0, 1).double().repeat_interleave(group, 0)
        vh = vs.transpose(0, 1).double().repeat_interleave(group, 0)
        visible = torch.ones(len(qs), len(ks), dtype=torch.bool).tril(len(ks) - len(qs))
        o = F.scaled_dot_product_attention(qs.transpose(0, 1).double(), kh, vh, attn_mask=visible, scale=step.scale)
        outs.append(o.transpose(0, 1))
    outs.append(torch.zeros(step.num_pad, *step.q.shape[1:], dtype=torch.float64))
    return torch.cat(outs)


def expected_cache(step):
    k_cache, v_cache = step.k_cache.clone(), step.v_cache.clone()
    for table, kk, vv in zip(step.tables, step.keys, step.values):
        rows = [slot_of(table, p, step.block_size) for p in range(len(kk))]
        k_cache.view(-1, *kk.shape[1:])[rows] = kk
        v_cache.view(-1, *vv.shape[1:])[rows] = vv
    return k_cache, v_cache


def run_and_check(backend, step, atol=1e-5):
    want_k, want_v = expected_cache(step)
    out = backend.forward(step.q, step.k, step.v, step.k_cache, step.v_cache, step.ctx, step.scale)
    assert out.shape == step.q.shape and out.dtype == step.q.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), dense_attention(step), atol=atol, rtol=0)
    torch.testing.assert_close(step.k_cache, want_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(step.v_cache, want_v, atol=0, rtol=0, equal_nan=True)
    return out


# --- TorchBackend against dense attention ---------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 3])
def test_fresh_prefill(block_size, group):
    step = make_step([(0, 7), (0, 1), (0, 20)], block_size=block_size, group=group, seed=block_size)
    assert step.ctx.block_tables is None
    run_and_check(TorchBackend(), step)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_over_cached_prefix_and_chunks(block_size, group):
    specs = [(block_size * 2, 5), (0, 3), (block_size + 3, 1), (17, 9)]   # prefix hit, fresh, chunk ends mid-block
    run_and_check(TorchBackend(), make_step(specs, block_size=block_size, group=group, seed=group))


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_pad", [0, 3])
def test_decode(block_size, num_pad):
    specs = [(0, 1), (block_size - 1, 1), (block_size, 1), (45, 1)]
    run_and_check(TorchBackend(), make_step(specs, decode=True, block_size=block_size, group=2, num_pad=num_pad))


@pytest.mark.parametrize("seed", range(30))
def test_random_layouts(seed):
    rng = np.random.default_rng(seed)
    block_size = int(rng.choice([1, 2, 4, 8, 16]))
    group = int(rng.choice([1, 2, 4]))
    num_seqs = int(rng.integers(1, 6))
    if seed % 2:
        specs = [(int(rng.integers(0, 50)), 1) for _ in range(num_seqs)]
        step = make_step(specs, decode=True, num_pad=int(rng.integers(0, 4)), block_size=block_size, group=group,
                         spare_blocks=int(rng.integers(0, 4)), seed=seed)
    else:
        specs = [(int(rng.choice([0, block_size * int(rng.integers(1, 4)), int(rng.integers(1, 40))])),
                  int(rng.integers(1, 15))) for _ in range(num_seqs)]
        step = make_step(specs, block_size=block_size, group=group, spare_blocks=int(rng.integers(0, 4)), seed=seed)
    run_and_check(TorchBackend(), step)


def test_bfloat16_matches_float32_reference():
    step = make_step([(9, 1), (30, 1)], decode=True, num_pad=1, dtype=torch.bfloat16)
    run_and_check(TorchBackend(), step, atol=2e-2)
    step = make_step([(9, 4), (0, 6)], dtype=torch.bfloat16)
    run_and_check(TorchBackend(), step, atol=2e-2)


def test_padding_rows_are_zero_and_change_nothing_else():
    padded = make_step([(7, 1), (30, 1), (0, 1)], decode=True, num_pad=4)
    plain = make_step([(7, 1), (30, 1), (0, 1)], decode=True, num_pad=0)
    out_padded = run_and_check(TorchBackend(), padded)
    out_plain = run_and_check(TorchBackend(), plain)
    assert torch.equal(out_padded[:3], out_plain)
    assert torch.equal(out_padded[3:], torch.zeros_like(out_padded[3:]))


def test_decode_reads_only_owned_rows():
    """Garbage (NaN, inf) in every row a sequence does not own, or beyond its length, must not reach the output."""
    step = make_step([(5, 1), (12, 1)], decode=True, num_pad=2, block_size=8, spare_blocks=3)
    step.k_cache[torch.isnan(step.k_cache)] = float("inf")
    out = run_and_check(TorchBackend(), step)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("longest", ["counted", "beyond the tables"])
def test_decode_reads_slots_up_to_the_longest_context_the_runner_counts(longest):
    """The runner's max_seqlen_k bounds the slots decode gathers; a bound past the tables reads them all."""
    specs = [(5, 1), (12, 1), (0, 1)]
    whole = run_and_check(TorchBackend(), make_step(specs, decode=True, num_pad=2, block_size=8))
    step = make_step(specs, decode=True, num_pad=2, block_size=8)
    step.ctx.max_seqlen_k = int(step.ctx.context_lens.max()) if longest == "counted" else 10**6
    torch.testing.assert_close(run_and_check(TorchBackend(), step), whole, atol=1e-6, rtol=0)


def test_without_cache_is_a_plain_packed_prefill():
    step = make_step([(0, 5), (0, 3)])
    empty = torch.tensor([])
    out = TorchBackend().forward(step.q, step.k, step.v, empty, empty, step.ctx, step.scale)
    torch.testing.assert_close(out.double(), dense_attention(step), atol=1e-5, rtol=0)


def test_key_slots():
    cu = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
    tables = torch.tensor([[4, 1], [2, -1], [0, -1]], dtype=torch.int32)
    assert key_slots(cu, tables, 2).tolist() == [8, 9, 2, 4, 5, 0]
    assert key_slots(cu, tables, 2, num_keys=6).tolist() == [8, 9, 2, 4, 5, 0]


def test_gather_keys_reads_the_cached_keys_from_the_pool_and_the_new_ones_as_given():
    step = make_step([(5, 3), (0, 2), (9, 1), (4, 4)], seed=7)
    pa.store_kv(step.k, step.v, step.k_cache, step.v_cache, step.ctx.slot_mapping)
    rows = key_slots(step.ctx.cu_seqlens_k, step.ctx.block_tables, step.k_cache.shape[1])
    whole = step.k_cache.flatten(0, 1)[rows], step.v_cache.flatten(0, 1)[rows]  # all from the pool
    k, v = pa.gather_keys(step.k, step.v, step.k_cache, step.v_cache, step.ctx, None)
    assert torch.equal(k, whole[0]) and torch.equal(v, whole[1])
    sources = step.ctx.key_sources  # worked out once, for every layer of the step
    assert [len(x) for x in sources] == [18, 18, 10]
    new_k = step.k + 1  # the new rows come from k and v, not the pool
    k, _ = pa.gather_keys(new_k, step.v, step.k_cache, step.v_cache, step.ctx, None)
    assert step.ctx.key_sources is sources
    assert torch.equal(k[sources[2]], new_k) and torch.equal(k[sources[1]], whole[0][sources[1]])


PACK_CHECK = r"""
import torch
from nanoengine.kernels.kv_fp8 import fp8_value_layout, quantize_kv
from nanoengine.layers.paged_attention import gather_keys, key_sources, pack_keys_triton
from nanoengine.utils.context import Context

g = torch.Generator().manual_seed(0)
blocks, bs, hk, d = 6, 4, 3, 16  # three KV heads: the kernel pads them to four
# (num_cached, num_new) per sequence: a prefix hit, a chunk boundary mid-block, a fresh prompt
for specs, fp8, v_runs, dtype in [([(5, 3), (0, 2), (9, 1)], True, False, torch.float16),
                                  ([(4, 4), (7, 2)], True, True, torch.float32),
                                  ([(6, 2), (0, 3)], False, False, torch.float32)]:
    raw = [torch.randn(blocks, bs, hk, d, generator=g) * 3 for _ in range(2)]
    if fp8:
        (kc, ks), (vc, vs) = quantize_kv(raw[0]), quantize_kv(raw[1])
        scales = (ks, vs)
        if v_runs:  # V laid out as the engine lays a float8 pool out, in runs of 2 slots
            vc = fp8_value_layout(torch.empty_like(vc), run=2).copy_(vc.reshape(-1, 2, hk, d))
    else:
        (kc, vc), scales = (x.to(dtype) for x in raw), None
    table = torch.randperm(blocks, generator=g)
    tables, at = [], 0
    for c, n in specs:
        m = -(-(c + n) // bs)
        tables.append(table[at:at + m].tolist() + [-1] * (3 - m))
        at += m
    cu_q = torch.tensor([0] + [n for _, n in specs]).cumsum(0).int()
    cu_k = torch.tensor([0] + [c + n for c, n in specs]).cumsum(0).int()
    ctx = Context(is_prefill=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                  block_tables=torch.tensor(tables, dtype=torch.int32))
    k, v = (torch.randn(int(cu_q[-1]), hk, d, generator=g).to(dtype) for _ in range(2))
    want = gather_keys(k, v, kc, vc, ctx, scales)  # PyTorch, on the CPU
    got = pack_keys_triton(k, v, kc, vc, scales, *ctx.key_sources)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), (specs, fp8, v_runs)
    rows, cached_at, _ = ctx.key_sources  # sources with no new rows: every key from the pool
    only = pack_keys_triton(k, v, kc, vc, scales, rows, torch.arange(len(rows)), None)
    assert torch.equal(only[0], want[0][cached_at]) and torch.equal(only[1], want[1][cached_at])
    print("pack", specs)
print("ALL OK")
"""


def test_pack_keys_kernel_under_the_interpreter_equals_gather_keys():
    """The Triton gather of a prompt step's keys (a fresh process with TRITON_INTERPRET=1) writes exactly what
    gather_keys' PyTorch path writes: float8 pools with either V layout, and an unscaled pool."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", PACK_CHECK], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.strip().splitlines()[-1] == "ALL OK" and result.stdout.count("pack") == 3


def test_missing_context_fields_are_named():
    step = make_step([(4, 2)])
    empty = torch.tensor([])
    backend = TorchBackend()
    for field in ("slot_mapping", "cu_seqlens_q", "cu_seqlens_k"):
        bad = Context(**{f: getattr(step.ctx, f) for f in Context.__slots__})
        setattr(bad, field, None)
        with pytest.raises(RuntimeError, match=field):
            backend.forward(step.q, step.k, step.v, step.k_cache.clone(), step.v_cache.clone(), bad, step.scale)
    decode = Context(context_lens=torch.tensor([3]), block_tables=torch.tensor([[0]]), slot_mapping=torch.tensor([0]))
    with pytest.raises(RuntimeError, match="bind k_cache"):
        backend.forward(step.q[:1], step.k[:1], step.v[:1], empty, empty, decode, step.scale)
    with pytest.raises(RuntimeError, match="context_lens"):
        backend.forward(step.q[:1], step.k[:1], step.v[:1], step.k_cache, step.v_cache,
                        Context(slot_mapping=step.ctx.slot_mapping[:1]), step.scale)
    with pytest.raises(RuntimeError, match="no cache is bound"):
        backend.forward(step.q, step.k, step.v, empty, empty, step.ctx, step.scale)
    fresh = Context(is_prefill=True, cu_seqlens_q=step.ctx.cu_seqlens_q, cu_seqlens_k=step.ctx.cu_seqlens_k)
    with pytest.raises(RuntimeError, match="block_tables is None"):
        backend.forward(step.q, step.k, step.v, empty, empty, fresh, step.scale)


# --- Attention binds a backend ----------------------------------------------------------------------------------------

def attend(attn: Attention, step) -> torch.Tensor:
    """Run an Attention module on a step with the step's context published."""
    set_context(**{f: getattr(step.ctx, f) for f in Context.__slots__})
    try:
        return attn(step.q, step.k, step.v)
    finally:
        reset_context()


def test_attention_uses_the_bound_backend_and_cache():
    attn = Attention(num_heads=4, head_dim=8, scale=8 ** -0.5, num_kv_heads=2)
    assert attn.backend is None
    for step in (make_step([(5, 3), (0, 4)]), make_step([(5, 1), (11, 1)], decode=True, num_pad=1)):
        want_k, _ = expected_cache(step)
        attn.k_cache, attn.v_cache, attn.backend = step.k_cache, step.v_cache, TorchBackend()
        torch.testing.assert_close(attend(attn, step).double(), dense_attention(step), atol=1e-5, rtol=0)
        torch.testing.assert_close(step.k_cache, want_k, atol=0, rtol=0, equal_nan=True)


def test_attention_without_backend_keeps_the_plain_path():
    attn = Attention(num_heads=4, head_dim=8, scale=8 ** -0.5, num_kv_heads=2)
    step = make_step([(0, 5), (0, 2)])
    torch.testing.assert_close(attend(attn, step).double(), dense_attention(step), atol=1e-5, rtol=0)


# --- choosing a backend -----------------------------------------------------------------------------------------------

def test_get_attention_backend():
    assert isinstance(get_attention_backend(device="cpu", block_size=256), TorchBackend)
    assert isinstance(get_attention_backend("auto", device=torch.device("cuda"), block_size=16), TorchBackend)
    assert isinstance(get_attention_backend("torch", device="cuda", block_size=256), TorchBackend)
    with pytest.raises(ValueError, match="CUDA"):
        get_attention_backend("flash", device="cpu", block_size=256)
    with pytest.raises(ValueError, match="multiple of 256"):
        get_attention_backend("flash", device="cuda", block_size=128)
    with pytest.raises(ValueError, match=r"'auto', 'flash', 'torch'"):
        get_attention_backend("paged", device="cpu", block_size=256)
    with pytest.raises(ValueError, match="block_size"):
        get_attention_backend(device="cpu", block_size=0)
    with pytest.raises(ValueError, match="device"):
        get_attention_backend(device="gpu", block_size=256)
    assert FLASH_BLOCK_MULTIPLE == 256 and isinstance(flash_attn_available(), bool)


def test_flash_missing(monkeypatch):
    monkeypatch.setattr(pa, "flash_attn_available", lambda: False)
    assert "not installed" in flash_unavailable_reason("cuda", 512)
    with pytest.raises(ValueError, match="not installed"):
        get_attention_backend("flash", device="cuda", block_size=256)
    assert isinstance(get_attention_backend("auto", device="cuda", block_size=256), TorchBackend)


def test_auto_picks_flash_when_it_can(monkeypatch):
    monkeypatch.setattr(pa, "flash_attn_available", lambda: True)
    monkeypatch.setattr(pa, "FlashBackend", lambda: "flash backend")
    assert get_attention_backend("auto", device="cuda:0", block_size=512) == "flash backend"
    assert get_attention_backend("flash", device="cuda", block_size=256) == "flash backend"
    assert isinstance(get_attention_backend("auto", device="cpu", block_size=256), TorchBackend)


@pytest.mark.skipif(flash_attn_available(), reason="flash-attn is installed")
def test_flash_backend_without_flash_attn_says_what_to_install():
    with pytest.raises(ImportError, match="flash-attn"):
        FlashBackend()


# --- FlashBackend against TorchBackend on a GPU -----------------------------------------------------------------------

def to_cuda(step):
    ctx = Context(**{f: getattr(step.ctx, f).cuda() if torch.is_tensor(getattr(step.ctx, f)) else getattr(step.ctx, f)
                     for f in Context.__slots__})
    return [t.cuda() for t in (step.q, step.k, step.v)], ctx


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLASH_GPU, reason="needs a CUDA GPU and flash-attn")
@pytest.mark.parametrize("specs,decode", [
    ([(0, 300), (0, 17), (0, 600)], False),                                  # fresh prefill, no block tables
    ([(256, 100), (300, 45), (0, 33), (512, 1)], False),                     # prefix hit, chunk, fresh, one-token chunk
    ([(0, 1), (254, 1), (255, 1), (256, 1), (899, 1)], True),                # decode across block boundaries
])
def test_flash_matches_torch_in_bfloat16(specs, decode):
    step = make_step(specs, decode=decode, num_pad=2 if decode else 0, block_size=256, num_kv_heads=2, group=4,
                     head_dim=128, dtype=torch.bfloat16)
    (q, k, v), ctx = to_cuda(step)
    flash = get_attention_backend("flash", device="cuda", block_size=256)
    assert isinstance(flash, FlashBackend)
    k_flash, v_flash = step.k_cache.cuda(), step.v_cache.cuda()
    k_torch, v_torch = step.k_cache.cuda(), step.v_cache.cuda()
    out_flash = flash.forward(q, k, v, k_flash, v_flash, ctx, step.scale)
    out_torch = TorchBackend().forward(q, k, v, k_torch, v_torch, ctx, step.scale)
    torch.cuda.synchronize()
    assert out_flash.shape == q.shape and out_flash.dtype == torch.bfloat16
    assert torch.isfinite(out_flash).all()
    torch.testing.assert_close(out_flash.float(), out_torch.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(out_flash.double().cpu(), dense_attention(step), atol=3e-2, rtol=0)
    torch.testing.assert_close(k_flash, k_torch, atol=0, rtol=0, equal_nan=True)
    if decode:
        assert torch.equal(out_flash[-2:], torch.zeros_like(out_flash[-2:]))


# --- the start-up probe ------------------------------------------------------------------------------------------------

class ForgetfulBackend(TorchBackend):
    """Decode that drops each sequence's newest key, as a kernel for the wrong head dim might."""
    def decode(self, q, k_cache, v_cache, ctx, scale):
        shorter = Context(**{f: getattr(ctx, f) for f in Context.__slots__})
        shorter.context_lens = (ctx.context_lens - 1).clamp(min=1)
        return super().decode(q, k_cache, v_cache, shorter, scale)


class RaisingBackend(TorchBackend):
    """A build that lacks the head dim: every call raises."""
    def prefill(self, *args):
        raise RuntimeError("trimmed flash-attn build: head_dim must be one of [128]")


PROBE_SHAPE = dict(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu", block_size=8)


def test_flash_probe_accepts_a_correct_backend_and_names_a_wrong_one():
    assert pa.flash_probe(TorchBackend(), **PROBE_SHAPE) is None
    assert pa.flash_probe(ForgetfulBackend(), **PROBE_SHAPE).startswith("decode differs")
    assert "head_dim must be one of [128]" in pa.flash_probe(RaisingBackend(), **PROBE_SHAPE)


@pytest.mark.parametrize("bad", [ForgetfulBackend, RaisingBackend])
def test_a_flash_build_that_fails_the_probe_is_never_trusted(monkeypatch, bad):
    monkeypatch.setattr(pa, "flash_unavailable_reason", lambda device, block_size: None)
    monkeypatch.setattr(pa, "FlashBackend", bad)
    kwargs = dict(device="cpu", block_size=8, shape=(4, 2, 16), dtype=torch.float32)
    with pytest.warns(UserWarning, match="start-up check at head_dim 16"):
        backend = get_attention_backend("auto", **kwargs)
    assert type(backend) is TorchBackend
    with pytest.raises(ValueError, match="rebuild it with this head dim"):
        get_attention_backend("flash", **kwargs)
    monkeypatch.setattr(pa, "FlashBackend", type("GoodFlash", (TorchBackend,), {}))
    assert type(get_attention_backend("flash", **kwargs)).__name__ == "GoodFlash"


@pytest.mark.parametrize("bad", ["float order", "short order", "too many rows"])
def test_paged_decode_refuses_a_bad_order_or_batch_before_launching(bad):
    """The Triton decode kernel's wrapper names a wrong `order` or an oversize batch, on any device."""
    pytest.importorskip("triton")
    from nanoengine.kernels.paged_decode import paged_decode

    rows = 65_536 if bad == "too many rows" else 3
    q = torch.zeros(rows, 4, 16)
    caches = torch.zeros(2, 16, 2, 16), torch.zeros(2, 16, 2, 16)
    tables, lens = torch.zeros(rows, 1, dtype=torch.int32), torch.ones(rows, dtype=torch.int32)
    order = {"float order": torch.zeros(3), "short order": torch.arange(2)}.get(bad)
    with pytest.raises(ValueError, match="order must be|at most 65,535 sequences"):
        paged_decode(q, *caches, tables, lens, 0.25, order)
