"""Issue 16: streams mixed with other calls, engines of one and two ranks in one process, and inputs or states that
used to slip past the checks. Every test runs on CPU."""
import dataclasses
import gc
import itertools
import json
import pickle
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from nanoengine import LLM, SamplingParams
from nanoengine.engine.sequence import Sequence
from nanoengine.models.checkpoint import write_random_checkpoint

ENGINE = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("rel") / "tiny", "tiny", seed=0,
                                   tie_word_embeddings=False)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, **ENGINE)


def copy_checkpoint(ckpt, dest, skip=()):
    dest.mkdir()
    for f in ckpt.iterdir():
        if f.name not in skip:
            shutil.copy(f, dest / f.name)
    return dest


def collect(events):
    """Tokens and finished events per request index of a list of StreamEvents."""
    tokens, finished = {}, {}
    for e in events:
        tokens.setdefault(e.index, []).extend(e.token_ids)
        finished[e.index] = finished.get(e.index, 0) + e.finished
    return tokens, finished


# Item 1: engines of one and two ranks in one process, in both build orders (a subprocess, so that a regression
# is a failed test within two minutes instead of a 600-second gloo timeout).
def test_one_rank_and_two_rank_engines_in_one_process_in_both_orders(ckpt, tmp_path):
    script = tmp_path / "mix.py"
    script.write_text(textwrap.dedent(f"""
        import json, time
        from nanoengine import LLM, SamplingParams
        if __name__ == "__main__":
            kw = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)
            greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            prompts = [[5, 6, 7, 8], [9, 10, 11]]
            out = lambda llm: [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
            t0 = time.perf_counter()
            before = LLM({str(ckpt)!r}, **kw)
            reference = out(before)
            tp = LLM({str(ckpt)!r}, tensor_parallel_size=2, **kw)
            after = LLM({str(ckpt)!r}, **kw)
            results = [out(before), out(tp), out(after), out(before)]
            tp.close()
            results.append(out(after))
            print(json.dumps({{"reference": reference, "results": results,
                               "seconds": time.perf_counter() - t0}}), flush=True)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(r == report["reference"] for r in report["results"])
    assert report["seconds"] < 120


# Items 2 and 3: a stream delivers every token and exactly one finished event whoever steps the engine.
def test_generate_inside_a_stream_loop_finishes_the_streamed_request(llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]["token_ids"]
    events = []
    for event in llm.stream([[5, 6, 7]], params):
        events.append(event)
        if len(events) == 3:  # the streamed request finishes during this call
            llm.generate([[1, 2]], SamplingParams(max_tokens=60, ignore_eos=True), use_tqdm=False)
    tokens, finished = collect(events)
    assert tokens[0] == reference and finished == {0: 1} and events[-1].finished
    assert events[-1].finish_reason == "length" and llm.is_finished()


def test_two_streams_read_alternately_each_get_every_token(llm):
    short, long = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), \
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference = [o["token_ids"] for o in llm.generate([[5, 6, 7], [8, 9]], [short, long], use_tqdm=False)]
    a, b = [], []
    for ea, eb in itertools.zip_longest(llm.stream([[5, 6, 7]], short), llm.stream([[8, 9]], long)):
        a += [ea] if ea else []
        b += [eb] if eb else []
    (ta, fa), (tb, fb) = collect(a), collect(b)
    assert [ta[0], tb[0]] == reference and fa == fb == {0: 1}
    assert len(ta[0]) == 10 and len(tb[0]) == 20 and llm.is_finished()


def test_a_half_read_stream_advances_alongside_and_is_aborted_when_dropped(llm):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    stream = llm.stream([[3, 4, 5]], params)
    first = next(stream)
    llm.generate([[1, 2]], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    rest = list(stream)  # it advanced during generate(): nothing is lost, nothing is repeated
    tokens, finished = collect([first, *rest])
    assert tokens[0] == llm.generate([[3, 4, 5]], params, use_tqdm=False)[0]["token_ids"] and finished == {0: 1}
    dropped = llm.stream([[3, 4, 5]], params)
    next(dropped)
    del dropped
    gc.collect()
    bm = llm.scheduler.block_manager
    assert llm.is_finished() and bm.num_free_blocks == bm.num_blocks


def test_closing_a_stream_with_a_step_planned_ahead_leaves_the_engine_finished(llm):
    assert llm._can_plan_ahead(), "the async path runs on CPU too"
    stream = llm.stream(["a long enough prompt for a few blocks"] * 3, SamplingParams(max_tokens=20,
                                                                                     ignore_eos=True))
    for _ in range(4):  # the prefill event, then decode events
        next(stream)
    assert llm._in_flight is not None, "a decode step planned ahead is in flight"
    stream.close()
    bm = llm.scheduler.block_manager
    assert llm.is_finished() and llm._in_flight is None and bm.num_free_blocks == bm.num_blocks


def test_a_stream_checks_its_requests_when_called(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.stream([[1, 10**6]])
    assert llm.is_finished()


# Item 5: a tokenizer with more ids than the model's vocabulary.
def test_text_that_encodes_outside_the_vocabulary_is_refused(ckpt, tmp_path):
    small = write_random_checkpoint(tmp_path / "small", "tiny", seed=0, vocab_size=300)
    big_tokenizer = tmp_path / "mismatch"
    copy_checkpoint(small, big_tokenizer, skip=("tokenizer.json", "tokenizer_config.json",
                                                "chat_template.jinja", "special_tokens_map.json"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ckpt / name, big_tokenizer / name)  # 384 ids for a 300-row vocabulary
    with pytest.warns(UserWarning, match="tokenizer has 384 token ids but the model's vocabulary has 300"):
        llm = LLM(big_tokenizer, **ENGINE)
    text = next(t for t in ["zebras jump", "The quick brown fox", "Numbers 1024 256 dtype epsilon"]
                if max(llm.tokenizer.encode(t)) >= 300)
    with pytest.raises(ValueError, match=r"prompt 1: the tokenizer encodes the text to token id \d+, outside the "
                                         r"model's vocabulary \[0, 300\)"):
        llm.generate(["a", text], use_tqdm=False)
    assert llm.is_finished()
    assert len(llm.generate([[5, 6]], GREEDY, use_tqdm=False)[0]["token_ids"]) == 10


# Item 6: a checkpoint without tokenizer files.
def test_a_checkpoint_without_a_tokenizer_says_so_and_serves_token_ids(ckpt, tmp_path):
    bare = copy_checkpoint(ckpt, tmp_path / "bare", skip=("tokenizer.json", "tokenizer_config.json",
                                                          "chat_template.jinja", "special_tokens_map.json"))
    with pytest.warns(UserWarning, match="has no tokenizer"):
        llm = LLM(bare, **ENGINE)
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="prompt 0 is text, but this model has no tokenizer"):
        llm.generate(["hi"], use_tqdm=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    out = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]
    assert len(out["token_ids"]) == 10 and out["text"] is None
    events = list(llm.stream([[5, 6, 7]], GREEDY))
    assert sum(len(e.token_ids) for e in events) == 10 and all(e.text is None for e in events)


# Item 7: tiny temperatures are greedy.
@pytest.mark.parametrize("temperature", [1e-44, 1e-46, 1e-6])
def test_a_tiny_temperature_is_greedy(llm, temperature):
    params = SamplingParams(temperature=temperature, max_tokens=10, ignore_eos=True)
    assert params.temperature == 0.0 and params.greedy
    prompts = [[5, 6, 7], [40, 41]]
    assert [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)] == \
        [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


# Item 8: clear errors.
@pytest.mark.parametrize("call, error, message", [
    (lambda llm: llm.chat([{"role": "user"}]), ValueError, "conversation 0, message 0 has no 'content'"),
    (lambda llm: llm.chat([{"role": "user", "content": 5}]), TypeError,
     "conversation 0, message 0: 'content' must be a string, got 5"),
    (lambda llm: llm.chat([[{"role": "user", "content": "a"}], [{"content": "b"}]]), ValueError,
     "conversation 1, message 0 has no 'role'"),
    (lambda llm: llm.chat([{"role": "user", "content": "a"}, "hello"]), TypeError, "conversation 0, message 1"),
    (lambda llm: llm.chat("hello"), TypeError, "conversations must be a list"),
    (lambda llm: llm.abort(None), TypeError, "abort\\(\\) takes a Sequence"),
    (lambda llm: llm.abort(Sequence([1, 2], block_size=16)), ValueError, "not a request of this engine"),
    (lambda llm: llm.generate([[1, 2]], use_tqdm="no"), TypeError, "use_tqdm"),
    (lambda llm: llm.chat([{"role": "user", "content": "a"}], use_tqdm="no"), TypeError, "use_tqdm"),
    (lambda llm: llm.generate([[1, np.int64(10**6)]]), ValueError, "outside the vocabulary"),
    (lambda llm: llm.generate([[1, True]]), TypeError, "ints"),
])
def test_bad_calls_name_the_problem(llm, call, error, message):
    with pytest.raises(error, match=message):
        call(llm)
    assert llm.is_finished()


def test_numpy_integer_token_ids_are_accepted(llm):
    reference = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]["token_ids"]
    for prompt in ([np.int64(5), np.int32(6), np.uint8(7)], list(np.array([5, 6, 7]))):
        out = llm.generate(prompt, GREEDY, use_tqdm=False)  # one prompt given as a bare id list
        assert out[0]["token_ids"] == reference and out[0]["prompt_token_ids"] == [5, 6, 7]
        assert all(type(t) is int for t in out[0]["prompt_token_ids"])
    seq = llm.add_request([np.int64(5), np.int64(6)], GREEDY)
    while not llm.is_finished():
        llm.step()
    assert len(seq.completion_token_ids) == 10


def test_a_truncated_safetensors_file_is_an_oserror_naming_it(ckpt, tmp_path):
    broken = copy_checkpoint(ckpt, tmp_path / "broken")
    blob = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(OSError, match="model.safetensors.*truncated or corrupt"):
        LLM(broken, **ENGINE)


def test_a_kv_pool_larger_than_memory_is_refused_before_allocating(ckpt):
    with pytest.raises(ValueError, match=r"num_kvcache_blocks=1000000000 \(the KV cache\) needs [\d,.]+ GiB "
                                         r"\([\d,]+ bytes\) but cpu has only .* available; lower num_kvcache"):
        LLM(ckpt, device="cpu", kvcache_block_size=16, num_kvcache_blocks=10**9)


# Item 9: state that slipped past the checks.
def test_every_call_on_a_closed_engine_raises(ckpt):
    llm = LLM(ckpt, **ENGINE)
    seq = llm.add_request([5, 6, 7], GREEDY)
    llm.step()
    llm.close()
    assert seq.is_finished and seq.finish_reason == "abort", "close() aborts what was queued"
    calls = [lambda: llm.add_request([1, 2]), lambda: llm.generate([[1, 2]], use_tqdm=False),
             lambda: llm.stream([[1, 2]]), lambda: llm.chat([{"role": "user", "content": "a"}]),
             llm.step, llm.drain, llm.is_finished, lambda: llm.abort(seq), lambda: llm.__enter__()]
    for call in calls:
        with pytest.raises(RuntimeError, match="this engine is closed"):
            call()
    llm.close()  # idempotent


def test_a_stream_open_when_its_engine_closes_reports_the_abort(ckpt):
    llm = LLM(ckpt, **ENGINE)
    stream = llm.stream([[5, 6, 7]], GREEDY)
    next(stream)
    llm.close()
    rest = list(stream)
    assert [(e.finished, e.finish_reason) for e in rest] == [(True, "abort")]


def test_sampling_params_cannot_change_after_construction(llm):
    params = SamplingParams(max_tokens=5)
    for field, value in [("max_tokens", -5), ("temperature", float("nan")), ("top_k", 0)]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(params, field, value)
    with pytest.raises(ValueError, match="max_tokens"):
        dataclasses.replace(params, max_tokens=-5)
    assert pickle.loads(pickle.dumps(params)) == params
    assert len(llm.generate([[5, 6]], dataclasses.replace(params, max_tokens=3, ignore_eos=True),
                            use_tqdm=False)[0]["token_ids"]) == 3


def test_a_corrupt_generation_config_is_an_error_and_a_missing_one_is_fine(ckpt, tmp_path):
    corrupt = copy_checkpoint(ckpt, tmp_path / "corrupt")
    (corrupt / "generation_config.json").write_text("{not json")
    with pytest.raises(OSError, match="generation_config.json.*cannot be read"):
        LLM(corrupt, **ENGINE)
    missing = copy_checkpoint(ckpt, tmp_path / "missing", skip=("generation_config.json",))
    llm = LLM(missing, **ENGINE)
    assert llm.eos_token_ids == (llm.tokenizer.eos_token_id,)


def test_the_offline_hub_error_does_not_suggest_an_argument_llm_lacks(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError) as info:
        LLM("nanoengine-tests/no-such-model")
    assert "HF_HUB_OFFLINE" in str(info.value) and "local_files_only" not in str(info.value)
