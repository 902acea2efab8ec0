"""End-to-end engine tests on CPU: exactness against transformers, ordering, leaks, errors, streaming."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from nanoengine import LLM, SamplingParams
from nanoengine.models.checkpoint import write_random_checkpoint

MAX_NEW = 24


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def hf(ckpt):
    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def small_llm(ckpt):
    return LLM(ckpt, device="cpu", kvcache_block_size=16, num_kvcache_blocks=24, max_num_batched_tokens=64,
               max_model_len=512)


def transformers_greedy(hf, prompt: list[int], eos_ids, max_new: int = MAX_NEW) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=max_new, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[:i + 1]
    return tokens


def test_greedy_equals_transformers_with_chunking_prefix_hits_and_preemption(small_llm, hf):
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 380, (70,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 380, (n,), generator=g).tolist() for n in (5, 17, 33, 2, 40, 9, 26)]
    prompts.append(list(prompts[2]))
    expected = [transformers_greedy(hf, p, small_llm.eos_token_ids) for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    small_llm.trace.clear()
    hits_before = small_llm.scheduler.block_manager.num_hit_blocks
    first = [o["token_ids"] for o in small_llm.generate(prompts, greedy, use_tqdm=False)]
    trace = list(small_llm.trace)
    assert first == expected
    assert any(r.is_prefill and r.num_tokens == 64 for r in trace), "a prompt was chunked"
    assert sum(r.num_preempted for r in trace) > 0, "preemption happened"
    assert small_llm.scheduler.block_manager.num_hit_blocks > hits_before, "the shared prefix was reused"
    second = [o["token_ids"] for o in small_llm.generate(prompts, greedy, use_tqdm=False)]
    assert second == expected, "warm prefix cache"
    again = small_llm.generate([prompts[2]], greedy, use_tqdm=False)[0]["token_ids"]
    assert again == expected[2], "a repeated prompt (full cache hit)"
    bm = small_llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_two_thousand_requests_finish_in_input_order_without_leaking(ckpt):
    llm = LLM(ckpt, device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)
    prompts = [[(7 * i) % 300 + 1, (3 * i) % 200 + 1, i % 97 + 1][: 1 + i % 3] for i in range(2000)]
    params = [SamplingParams(temperature=0, max_tokens=1 + i % 5, ignore_eos=True) for i in range(2000)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o["token_ids"]) for o in outs] == [1 + i % 5 for i in range(2000)]
    assert [o["prompt_token_ids"] for o in outs] == prompts
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.used_block_ids


@pytest.mark.parametrize("call, error, message", [
    (lambda llm: llm.generate([[5] * 500], SamplingParams(max_tokens=20)), ValueError, "max_model_len"),
    (lambda llm: llm.generate([[5] * 300], SamplingParams(max_tokens=200)), ValueError, "KV blocks"),
    (lambda llm: llm.generate([""]), ValueError, "empty"),
    (lambda llm: llm.generate([[]]), ValueError, "empty"),
    (lambda llm: llm.generate([[1, 2, 10**6]]), ValueError, "outside the vocabulary"),
    (lambda llm: llm.generate([[1, -3]]), ValueError, "outside the vocabulary"),
    (lambda llm: llm.generate([[1, 2.5]]), TypeError, "ints"),
    (lambda llm: llm.generate([3.14]), TypeError, "prompt 0"),
    (lambda llm: llm.generate(["a", "b"], [SamplingParams()] * 3), ValueError, "one per prompt"),
    (lambda llm: llm.generate(["a"], [{"temperature": 0}]), TypeError, "SamplingParams"),
    (lambda llm: SamplingParams(temperature=-1), ValueError, "temperature"),
])
def test_bad_input_is_rejected_before_any_work_and_the_engine_keeps_serving(small_llm, call, error, message):
    steps_before = small_llm.scheduler.num_steps
    with pytest.raises(error, match=message):
        call(small_llm)
    assert small_llm.scheduler.num_steps == steps_before and small_llm.is_finished(), "no work was done"
    out = small_llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0]["token_ids"]) >= 1


def test_bad_engine_arguments(ckpt, tmp_path):
    with pytest.raises(TypeError, match="did you mean .max_num_seqs."):
        LLM(ckpt, device="cpu", max_num_seq=8)
    with pytest.raises(OSError, match="no/such"):
        LLM("/no/such/model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(OSError, match="config.json"):
        LLM(tmp_path / "empty")
    with pytest.raises(ValueError, match="kvcache_block_size"):
        LLM(ckpt, device="cpu", kvcache_block_size=24)
    with pytest.raises(ValueError, match="flash"):
        LLM(ckpt, device="cpu", attention_backend="flash")
    with pytest.raises(TypeError, match="async_scheduling"):
        LLM(ckpt, device="cpu", async_scheduling="yes")


def test_defaults_on_cpu_and_string_dtypes(ckpt):
    llm = LLM(ckpt, kvcache_block_size=16, max_model_len=128)
    assert llm.config.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        assert llm.config.dtype == torch.float32 and llm.config.num_kvcache_blocks >= 8
    bf16 = LLM(ckpt, device="cpu", dtype="bfloat16", kvcache_block_size=16, num_kvcache_blocks=16, max_model_len=128)
    assert bf16.model_runner.kv_cache.dtype == torch.bfloat16
    assert len(bf16.generate(["hi"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]["token_ids"]) > 0


def test_stream_yields_the_same_tokens_as_generate_and_chat_works(small_llm):
    params = SamplingParams(temperature=0, max_tokens=6)
    prompts = ["Once upon a time", "In a galaxy far away"]
    collected = {0: [], 1: []}
    finished = []
    for event in small_llm.stream(prompts, params):
        collected[event.index] += event.token_ids
        if event.finished:
            finished.append(event.index)
    reference = small_llm.generate(prompts, params, use_tqdm=False)
    assert [collected[0], collected[1]] == [r["token_ids"] for r in reference]
    assert sorted(finished) == [0, 1]
    reply = small_llm.chat([{"role": "user", "content": "Hello"}], params, use_tqdm=False)
    assert 1 <= len(reply[0]["token_ids"]) <= 6


@pytest.mark.parametrize("num_events", [1, 5])
def test_abandoned_stream_frees_its_blocks(small_llm, num_events):
    """Closed after its prefill or after decode steps, each time with the next step planned ahead and in flight
    (async scheduling, on CPU too)."""
    assert small_llm._can_plan_ahead()
    stream = small_llm.stream(["a long enough prompt for a few blocks"] * 3,
                              SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(num_events):
        next(stream)
    assert small_llm._in_flight is not None, "the step planned ahead is in flight"
    stream.close()
    bm = small_llm.scheduler.block_manager
    assert small_llm.is_finished() and small_llm._in_flight is None and bm.num_free_blocks == bm.num_blocks


def test_seeded_sampling_is_reproducible_in_any_batch(small_llm):
    seeded = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=11, max_tokens=10)
    alone = small_llm.generate([[4, 5, 6, 7]], seeded, use_tqdm=False)[0]["token_ids"]
    crowd = small_llm.generate([[9, 9], [4, 5, 6, 7], [1]], [SamplingParams(max_tokens=10), seeded,
                                                             SamplingParams(temperature=0.5, max_tokens=10)],
                               use_tqdm=False)
    assert crowd[1]["token_ids"] == alone


def _stop_heavy(llm, async_scheduling: bool):
    """Seeded sampling with many stop tokens, so requests stop while a step planned ahead is in flight."""
    llm.async_scheduling = async_scheduling
    llm.scheduler.eos_token_ids = frozenset(range(0, 384, 9))
    try:
        prompts = [[(7 * i + j) % 300 + 3 for j in range(5 + i)] for i in range(12)]
        params = [SamplingParams(temperature=0.8, seed=i, max_tokens=4 + 3 * i) for i in range(12)]
        llm.trace.clear()
        out = llm.generate(prompts, params, use_tqdm=False)
        return [(o["token_ids"], o["finish_reason"]) for o in out], list(llm.trace)
    finally:
        llm.scheduler.eos_token_ids = frozenset(llm.eos_token_ids)
        llm.async_scheduling = True


def test_async_scheduling_equals_synchronous_when_requests_stop_mid_flight(ckpt):
    llm = LLM(ckpt, device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)
    synchronous, sync_trace = _stop_heavy(llm, async_scheduling=False)
    ahead, ahead_trace = _stop_heavy(llm, async_scheduling=True)
    assert ahead == synchronous
    assert sum(reason == "stop" for _, reason in ahead) >= 3 and any(r == "length" for _, r in ahead)
    assert not any(r.planned_ahead for r in sync_trace) and sum(r.planned_ahead for r in ahead_trace) > 5
    # every step's launch was timed, the planned ones included (chapter 13 compares it with the step)
    assert all(r.launch_seconds > 0 for r in sync_trace + ahead_trace)
    assert all(t >= 0 for tokens, _ in ahead for t in tokens)
    bm = llm.scheduler.block_manager
    assert llm.is_finished() and bm.num_free_blocks == bm.num_blocks


def test_a_failed_launch_of_a_planned_step_recomputes_its_sequences(ckpt):
    llm = LLM(ckpt, device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    runner, launch = llm.model_runner, llm.model_runner.launch
    failures = []

    def flaky(seqs, is_prefill, **kwargs):
        if kwargs.get("after") is not None and not failures:
            failures.append(len(seqs))
            raise RuntimeError("simulated launch failure")
        return launch(seqs, is_prefill, **kwargs)

    runner.launch = flaky
    seqs = [llm.add_request(p, greedy) for p in prompts]
    with pytest.raises(RuntimeError, match="simulated"):
        while not llm.is_finished():
            llm.step()
    assert failures == [2] and all(s.status.name == "WAITING" and s.last_token >= 0 for s in seqs)
    while not llm.is_finished():
        llm.step()
    runner.launch = launch
    assert [s.completion_token_ids for s in seqs] == reference
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_abort_while_a_step_is_in_flight_and_step_on_an_idle_engine(small_llm):
    assert small_llm.step() == [] and small_llm.is_finished()
    seq = small_llm.add_request([3, 4, 5, 6], SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(4):
        small_llm.step()
    assert small_llm._in_flight is not None, "a decode step planned ahead is in flight"
    small_llm.abort(seq)
    assert seq.finish_reason == "abort" and len(seq.completion_token_ids) >= 4
    assert all(t >= 0 for t in seq.token_ids)
    bm = small_llm.scheduler.block_manager
    assert small_llm.is_finished() and bm.num_free_blocks == bm.num_blocks


def test_mixed_steps_split_for_a_backend_that_asks_equal_transformers(ckpt, hf, monkeypatch):
    """Section 08.1's split of a mixed step (decode rows as a decode step, prompt rows as a prefill), run on a CPU
    through TorchBackend's two paths; chunked prompts, a shared prefix (prompt rows with cached keys) and preemption."""
    import nanoengine.engine.model_runner as mr
    from nanoengine.layers.paged_attention import TorchBackend, TritonDecodeMixin

    parts = []

    class SplitTorch(TritonDecodeMixin, TorchBackend):
        decode = TorchBackend.decode

        def prefill(self, q, k, v, k_cache, v_cache, ctx, scale):
            if ctx.decode_rows is not None:
                d = len(ctx.decode_rows.context_lens)
                assert 0 < d < q.shape[0] and ctx.prompt_rows.cu_seqlens_q[-1] == q.shape[0] - d
                parts.append((d, ctx.prompt_rows.block_tables is not None))
            for c in (ctx,) if ctx.decode_rows is None else (ctx, ctx.prompt_rows):
                cached = int(c.cu_seqlens_k[-1] - c.cu_seqlens_q[-1])  # the runner's count, on the host
                assert c.num_cached_keys == (cached or None) and (c.block_tables is None) == (not cached)
            return super().prefill(q, k, v, k_cache, v_cache, ctx, scale)

    monkeypatch.setattr(mr, "select_attention_backend", lambda *a, **k: SplitTorch())
    llm = LLM(ckpt, device="cpu", kvcache_block_size=16, num_kvcache_blocks=24, max_num_batched_tokens=64,
              max_model_len=512)
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 380, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 380, (n,), generator=g).tolist() for n in (5, 60, 33, 2, 90, 9, 26)]
    expected = [transformers_greedy(hf, p, llm.eos_token_ids) for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    got = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert got == expected
    # a prompt arriving while another request decodes: a mixed step whose prompt rows have nothing cached
    fresh = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (30, 11)]
    first = llm.add_request(fresh[0], greedy)
    for _ in range(3):
        llm.step()
    second = llm.add_request(fresh[1], greedy)
    while not llm.is_finished():
        llm.step()
    assert [first.completion_token_ids, second.completion_token_ids] == [
        transformers_greedy(hf, p, llm.eos_token_ids) for p in fresh]
    assert parts and any(cached for _, cached in parts) and any(not cached for _, cached in parts), parts
    llm.close()


def test_the_engine_hands_every_setting_to_config_by_name(ckpt):
    """Config(path, setting=setting, ...) is written out: every field of Config is an argument of the engine (and of
    LLM), and a value of each reaches the engine's config; the scheduler reads its flag from there."""
    from dataclasses import fields

    from nanoengine import Config, LLMEngine, Optimizations
    from nanoengine.engine.llm_engine import engine_arguments

    settings = {f.name for f in fields(Config)} - {"model", "hf_config"}
    assert settings <= set(engine_arguments(LLMEngine)) and settings <= set(engine_arguments(LLM))
    chosen = dict(max_num_batched_tokens=96, max_num_seqs=7, max_model_len=200, gpu_memory_utilization=0.5,
                  num_kvcache_blocks=20, kvcache_block_size=32, tensor_parallel_size=1, enforce_eager=True,
                  enable_prefix_caching=False, attention_backend="torch", kv_cache_dtype="fp8",
                  optimizations=Optimizations(plan_prompt_steps=False, batch_text_decode=False))
    assert set(chosen) | {"device", "dtype"} == settings, "every setting is tried"
    with LLMEngine(ckpt, device="cpu", dtype="bfloat16", **chosen) as engine:
        assert {name: getattr(engine.config, name) for name in chosen} == chosen
        assert (engine.config.device, engine.config.dtype) == (torch.device("cpu"), torch.bfloat16)
        assert not engine.scheduler.plan_prompt_steps and engine.scheduler.max_num_seqs == 7


def test_the_engine_is_handed_its_runner(ckpt):
    """make_runner(config, plan_ahead) builds rank 0's runner; the default builds one rank's and refuses more."""
    from nanoengine import LLMEngine
    from nanoengine.engine.llm_engine import one_rank_runner
    from nanoengine.engine.model_runner import ModelRunner

    calls = []

    def recording(config, plan_ahead):
        calls.append((config.num_kvcache_blocks, plan_ahead))
        return one_rank_runner(config, plan_ahead)

    for async_scheduling in (False, True):
        with LLMEngine(ckpt, device="cpu", kvcache_block_size=16, num_kvcache_blocks=16, max_model_len=128,
                       async_scheduling=async_scheduling, make_runner=recording) as engine:
            assert type(engine.model_runner) is ModelRunner and engine.config.num_kvcache_blocks == 16
    assert calls == [(16, False), (16, True)]
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs one process per rank.*nanoengine.LLM"):
        LLMEngine(ckpt, device="cpu", tensor_parallel_size=2)
    with pytest.raises(TypeError, match="LLMEngine.. got an unexpected keyword argument 'control_plane'"):
        LLMEngine(ckpt, device="cpu", control_plane="shm")  # a setting of LLM, the front door (14.3)


def test_the_start_up_step_over_a_cached_token_reads_it_from_the_pool(ckpt, monkeypatch):
    """warm_cached_prompt (run at start-up on a GPU, so that kernels only such steps launch compile then) runs one
    prompt step of one new token after one cached token, gathered from the still empty pool; an engine that ran it
    answers as one that did not."""
    import nanoengine.layers.paged_attention as pa
    kwargs = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=8, max_model_len=128)
    prompts, params = [[5, 6, 7] * 11, [9] * 40], SamplingParams(temperature=0.0, max_tokens=6)
    with LLM(ckpt, **kwargs) as llm:
        want = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(ckpt, **kwargs) as llm:
        seen, gather = [], pa.gather_keys
        monkeypatch.setattr(pa, "gather_keys", lambda k, v, kc, vc, ctx, s: (
            seen.append((k.shape[0], ctx.num_cached_keys)), gather(k, v, kc, vc, ctx, s))[1])
        llm.model_runner.warm_cached_prompt()
        assert seen and set(seen) == {(1, 1)}, seen
        monkeypatch.setattr(pa, "gather_keys", gather)
        assert [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)] == want
