"""Stop strings (chapter 10, section 6): SamplingParams(stop=[...]) in generate and stream."""
import itertools
import pickle
import shutil

import pytest

from nanoengine import LLM, Optimizations, SamplingParams
from nanoengine.engine.llm_engine import IncrementalText, find_stop, held_back
from nanoengine.models.checkpoint import write_random_checkpoint

ENGINE = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)
PROMPTS = ["The engine is", "Once upon a time", "In a galaxy far away"]
MAX = 24


def params(stop=(), max_tokens=MAX):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, stop=stop)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("stop") / "tiny", "tiny", seed=0,
                                   tie_word_embeddings=False)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, **ENGINE)


@pytest.fixture(scope="module")
def plain(llm):
    """Each prompt's greedy completion without stop strings."""
    return llm.generate(PROMPTS, params(), use_tqdm=False)


def prefix_texts(llm, token_ids):
    return [llm.tokenizer.decode(token_ids[:k], skip_special_tokens=True)
            for k in range(len(token_ids) + 1)]


def spanning_stop(llm, out, after=4):
    """A piece of `out`'s text (3 or 4 characters) that starts in one token and ends in the next."""
    texts = prefix_texts(llm, out["token_ids"])
    for k in range(after, len(texts) - 1):
        a = min(2, len(texts[k]) - len(texts[k - 1]))
        b = min(2, len(texts[k + 1]) - len(texts[k]))
        piece = texts[k + 1][len(texts[k]) - a:len(texts[k]) + b]
        if a >= 1 and b >= 1 and a + b >= 3 and texts[k + 1].startswith(texts[k]) \
                and "\ufffd" not in piece:
            return piece
    pytest.skip("no token boundary with enough characters on each side")


def check_stopped(llm, plain_out, out, stop):
    """out stopped at the earliest stop string of plain_out's text, keeping the last token."""
    cut = find_stop(plain_out["text"], tuple(stop))
    assert cut >= 0
    assert out["finish_reason"] == "stop"
    assert out["text"] == plain_out["text"][:cut]
    n = len(out["token_ids"])
    assert out["token_ids"] == plain_out["token_ids"][:n]
    decoded = prefix_texts(llm, out["token_ids"])
    assert find_stop(decoded[-1], tuple(stop)) >= 0 and find_stop(decoded[-2], tuple(stop)) < 0


def test_generate_stops_at_a_stop_string_that_spans_tokens(llm, plain):
    stop = spanning_stop(llm, plain[0])
    out = llm.generate(PROMPTS[0], params([stop]), use_tqdm=False)[0]
    check_stopped(llm, plain[0], out, [stop])
    assert len(out["token_ids"]) < MAX
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and llm.is_finished()


def test_the_earliest_of_several_stop_strings_wins(llm, plain):
    text = plain[1]["text"]
    late = spanning_stop(llm, plain[1], after=10)
    early = spanning_stop(llm, plain[1], after=4)
    assert text.find(early) < text.find(late)
    for stop in ([late, early], [early, late], ["never \u2603 here", late, early]):
        out = llm.generate(PROMPTS[1], params(stop), use_tqdm=False)[0]
        check_stopped(llm, plain[1], out, stop)
        assert out["text"] == text[:text.find(early)]


def test_a_stop_string_that_never_appears_changes_nothing(llm, plain):
    out = llm.generate(PROMPTS, params(["never \u2603 here"]), use_tqdm=False)
    assert [(o["token_ids"], o["text"], o["finish_reason"]) for o in out] == \
        [(o["token_ids"], o["text"], "length") for o in plain]


def test_a_batch_mixing_stops_matches_each_request_alone(llm, plain):
    stops = [[spanning_stop(llm, plain[0])], [], [spanning_stop(llm, plain[2], after=8)]]
    together = llm.generate(PROMPTS, [params(s) for s in stops], use_tqdm=False)
    alone = [llm.generate(p, params(s), use_tqdm=False)[0] for p, s in zip(PROMPTS, stops)]
    assert together == alone
    assert [o["finish_reason"] for o in together] == ["stop", "length", "stop"]


def test_stop_at_the_first_token_and_at_the_last_allowed_token(llm, plain):
    texts = prefix_texts(llm, plain[0]["token_ids"])
    first = texts[1][:1]
    out = llm.generate(PROMPTS[0], params([first]), use_tqdm=False)[0]
    assert out["text"] == "" and len(out["token_ids"]) == 1 and out["finish_reason"] == "stop"
    stop = spanning_stop(llm, plain[0])
    n = len(llm.generate(PROMPTS[0], params([stop]), use_tqdm=False)[0]["token_ids"])
    exact = llm.generate(PROMPTS[0], params([stop], max_tokens=n), use_tqdm=False)[0]
    assert exact["finish_reason"] == "stop" and len(exact["token_ids"]) == n  # stop beats length
    short = llm.generate(PROMPTS[0], params([stop], max_tokens=n - 1), use_tqdm=False)[0]
    assert short["finish_reason"] == "length"
    assert short["token_ids"] == plain[0]["token_ids"][:n - 1]


def test_stream_never_emits_part_of_a_stop_string(llm, plain):
    for i in range(len(PROMPTS)):
        stop = spanning_stop(llm, plain[i])
        reference = llm.generate(PROMPTS[i], params([stop]), use_tqdm=False)[0]
        events = list(llm.stream(PROMPTS[i], params([stop])))
        assert sum(e.finished for e in events) == 1 and events[-1].finish_reason == "stop"
        assert [t for e in events for t in e.token_ids] == reference["token_ids"]
        sent = list(itertools.accumulate(e.text for e in events))
        assert sent[-1] == reference["text"]
        assert all(reference["text"].startswith(s) for s in sent)  # nothing ever taken back
        tokens = list(itertools.accumulate(e.token_ids for e in events))
        decoded = [llm.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
        assert len(decoded[-2]) > len(sent[-2])  # the stop string's start was held back
        assert stop not in "".join(sent)


def test_streams_with_several_stop_strings_and_requests(llm, plain):
    stops = [[spanning_stop(llm, plain[0]), "never \u2603"], [], [spanning_stop(llm, plain[2])]]
    reference = llm.generate(PROMPTS, [params(s) for s in stops], use_tqdm=False)
    text = {i: "" for i in range(3)}
    reasons = {}
    for e in llm.stream(PROMPTS, [params(s) for s in stops]):
        text[e.index] += e.text
        assert reference[e.index]["text"].startswith(text[e.index])
        if e.finished:
            reasons[e.index] = e.finish_reason
    assert [text[i] for i in range(3)] == [o["text"] for o in reference]
    assert reasons == {0: "stop", 1: "length", 2: "stop"}


def test_a_stopped_request_frees_its_blocks_while_others_run(llm, plain):
    stop = spanning_stop(llm, plain[0])
    n = len(llm.generate(PROMPTS[0], params([stop]), use_tqdm=False)[0]["token_ids"])
    stopped = llm.add_request(PROMPTS[0], params([stop]))
    other = llm.add_request(PROMPTS[1], params(max_tokens=MAX))
    finished = []
    while not stopped.is_finished:
        finished += llm.step()
    assert stopped in finished and not other.is_finished
    assert stopped.block_table == [] and stopped.finish_reason == "stop"
    assert stopped.num_completion_tokens == n
    assert stopped not in llm.scheduler.running and not llm._stop_checkers
    while not llm.is_finished():
        llm.step()
        llm.drain()
    assert other.completion_token_ids == plain[1]["token_ids"]
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_async_and_synchronous_engines_agree(ckpt, plain, async_scheduling):
    llm = LLM(ckpt, async_scheduling=async_scheduling, **ENGINE)
    stops = [[spanning_stop(llm, o)] for o in plain]
    out = llm.generate(PROMPTS, [params(s) for s in stops], use_tqdm=False)
    for o, p, s in zip(out, plain, stops):
        check_stopped(llm, p, o, s)
    if async_scheduling:
        assert any(r.planned_ahead for r in llm.trace)
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_stop_strings_need_a_tokenizer(ckpt, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ckpt.iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                          "special_tokens_map.json"):
            shutil.copy(f, bare / f.name)
    with pytest.warns(UserWarning, match="has no tokenizer"):
        llm = LLM(bare, **ENGINE)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([[5, 6]], params(["x"]), use_tqdm=False)
    assert len(llm.generate([[5, 6]], params(), use_tqdm=False)[0]["token_ids"]) == MAX


def test_sampling_params_stop_validation_and_pickling():
    assert SamplingParams(stop="\n").stop == ("\n",) and SamplingParams().stop == ()
    assert SamplingParams(stop=["a", "b", "a"]).stop == ("a", "b")
    sp = SamplingParams(stop=["User:", "\n\n"])
    assert pickle.loads(pickle.dumps(sp)) == sp
    assert hash(sp) == hash(SamplingParams(stop=("User:", "\n\n")))
    for bad in ([""], ["a", ""], ["a", 1], 7, {"a"}, b"ab"):
        with pytest.raises(ValueError, match="stop"):
            SamplingParams(stop=bad)
    with pytest.raises(TypeError, match="stop"):
        SamplingParams(stop=[None])


def test_helpers():
    stop = ("User:", "\n\n")
    assert find_stop("Hi.\n\nUser:", stop) == 3 and find_stop("Hi", stop) == -1
    assert [held_back(t, stop) for t in ("Hi U", "Hi Use", "Hi User", "Hi.\n", "Hi", "")] == \
        [1, 3, 4, 1, 0, 0]
    assert held_back("xaa", ("ab",)) == 1 and held_back("aab", ("aab!",)) == 3


def test_incremental_text_reads_multibyte_text_token_by_token(llm):
    tok = llm.tokenizer
    phrase = tok.encode("naïve café ☃ snowman: done")
    from nanoengine.engine.sequence import Sequence
    for stop in (("☃ snow",), ("é ☃",), ("done",)):
        seq = Sequence([1] + phrase[:1], block_size=16)
        seq.num_prompt_tokens = 1
        checker = IncrementalText(tok, stop)
        hit = None
        for n in range(1, len(phrase) + 1):
            seq.token_ids, seq.num_tokens = [1] + phrase[:n], 1 + n
            if checker.update(seq):
                hit = n
                break
        assert hit is not None and stop[0] in tok.decode(phrase[:hit])
        assert stop[0] not in tok.decode(phrase[:hit - 1])


def test_stop_strings_through_chunking_preemption_and_prefix_hits(ckpt, llm):
    """A small pool and budget: the same stopped outputs as a roomy engine, and every block back."""
    system = "You are a helpful assistant. Answer in one short sentence. "
    prompts = [system + q for q in ("Why page the KV cache?", "What is a prefix cache?",
                                    "Why batch requests?", "What is a token?")]
    plain = llm.generate(prompts, params(max_tokens=40), use_tqdm=False)
    stops = [[spanning_stop(llm, o, after=k)] for o, k in zip(plain, (12, 20, 26, 30))]
    roomy = llm.generate(prompts, [params(s, max_tokens=40) for s in stops], use_tqdm=False)
    tight = LLM(ckpt, device="cpu", kvcache_block_size=16, num_kvcache_blocks=8,
                max_num_batched_tokens=32, max_model_len=256)
    out = tight.generate(prompts, [params(s, max_tokens=40) for s in stops], use_tqdm=False)
    assert out == roomy
    for o, p, s in zip(out, plain, stops):
        check_stopped(tight, p, o, s)
    trace = list(tight.trace)
    assert sum(r.num_preempted for r in trace) > 0 and any(r.is_prefill and r.num_tokens == 32
                                                          for r in trace)
    assert tight.scheduler.block_manager.num_hit_blocks > 0
    bm = tight.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not tight._stop_checkers


def test_a_stream_decodes_each_token_a_bounded_number_of_times(ckpt):
    """Streaming 120 tokens decodes O(n) tokens in all (a whole-completion decode per event would be ~7,000)."""
    with LLM(ckpt, **ENGINE) as llm:
        expected = llm.generate(PROMPTS[:1], params(max_tokens=120), use_tqdm=False)[0]
        decode, decoded = llm.tokenizer.decode, []

        def counting(ids, **kw):
            decoded.append(len(ids))
            return decode(ids, **kw)

        llm.tokenizer.decode = counting
        events = list(llm.stream(PROMPTS[:1], params(max_tokens=120)))
        llm.tokenizer.decode = decode
    assert "".join(e.text for e in events) == expected["text"]
    assert [t for e in events for t in e.token_ids] == expected["token_ids"]
    assert len(events) > 100 and sum(decoded) < 10 * 120, sum(decoded)


def test_batch_decode_gives_the_strings_decode_gives_one_by_one(llm):
    """generate decodes its completions in one Rust call; special and unknown ids included."""
    from nanoengine.engine.llm_engine import batch_decodable

    assert batch_decodable(llm.tokenizer)
    special = sorted(llm.tokenizer.all_special_ids)
    lists = [[], special, [5, special[0], 7, 2**20, 9], list(range(0, 400, 3)), [special[-1]] * 3]
    assert llm._decode_all(lists) == [llm._decode(ids) for ids in lists]


def test_batch_decode_falls_back_where_decode_is_changed(llm, monkeypatch):
    """A tokenizer that cleans up spaces (or overrides decode) is decoded one by one, unchanged."""
    from nanoengine.engine.llm_engine import batch_decodable

    monkeypatch.setattr(llm.tokenizer, "clean_up_tokenization_spaces", True)
    assert not batch_decodable(llm.tokenizer)
    ids = [[5, 6, 7], [8]]
    assert llm._decode_all(ids) == [llm._decode(i) for i in ids]
    monkeypatch.setattr(llm, "tokenizer", None)
    assert llm._decode_all(ids) == [None, None]


def test_generate_texts_equal_decode_one_by_one(llm, plain):
    outs = llm.generate(PROMPTS, params(), use_tqdm=False)
    assert [o["text"] for o in outs] == [llm._decode(o["token_ids"]) for o in plain]


def test_batch_text_decode_off_decodes_one_by_one_and_a_bad_value_is_refused(ckpt, llm, monkeypatch):
    """Optimizations(batch_text_decode=False) (the ladder's rung) takes the one-by-one path with the same strings; a
    value that is not a bool is refused before the engine loads anything."""
    ids = [[5, 6, 7], [8], list(range(40, 90))]
    expected = [llm.tokenizer.decode(i, skip_special_tokens=True) for i in ids]
    assert llm.config.optimizations.batch_text_decode and llm._decode_all(ids) == expected  # the default
    one_by_one = LLM(ckpt, optimizations=Optimizations(batch_text_decode=False), **ENGINE)
    try:
        calls = []
        decode = one_by_one._decode
        monkeypatch.setattr(one_by_one, "_decode", lambda token_ids: calls.append(token_ids) or decode(token_ids))
        assert not one_by_one.config.optimizations.batch_text_decode
        assert one_by_one._decode_all(ids) == expected and calls == ids
    finally:
        one_by_one.close()
    with pytest.raises(ValueError, match="optimizations.batch_text_decode"):
        LLM(ckpt, optimizations=Optimizations(batch_text_decode="no"), **ENGINE)


# --- stop token ids (section 10.1): vLLM's stop_token_ids, a stop at a token rather than a text ---


def first_new_token(out, skip: int = 3) -> tuple[int, int]:
    """A token id of the completion (after `skip` tokens) and where it first occurs."""
    ids = out["token_ids"]
    token = ids[skip]
    return token, ids.index(token)


def test_stop_token_ids_end_a_request_at_the_token_which_stays_in_the_output(llm, plain):
    for out, prompt in zip(plain, PROMPTS):
        token, at = first_new_token(out)
        stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX,
                                                      ignore_eos=True, stop_token_ids=[token]),
                               use_tqdm=False)[0]
        assert stopped["finish_reason"] == "stop"  # ignore_eos ignores only the EOS ids
        assert stopped["token_ids"] == out["token_ids"][:at + 1]
        assert stopped["text"] == llm.tokenizer.decode(out["token_ids"][:at + 1],
                                                       skip_special_tokens=True)
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and llm.is_finished()


def test_stop_token_ids_in_streams_and_beside_stop_strings(llm, plain):
    token, at = first_new_token(plain[1], skip=5)
    stop = spanning_stop(llm, plain[1], after=2)
    both = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True, stop=[stop],
                          stop_token_ids=[token])
    expected = llm.generate(PROMPTS[1], both, use_tqdm=False)[0]
    texts = prefix_texts(llm, plain[1]["token_ids"])
    by_text = next(k for k, t in enumerate(texts) if find_stop(t, (stop,)) >= 0)  # tokens
    assert expected["finish_reason"] == "stop"
    assert expected["token_ids"] == plain[1]["token_ids"][:min(at + 1, by_text)]  # the earlier
    events = list(llm.stream([PROMPTS[1]], both))
    assert [t for e in events for t in e.token_ids] == expected["token_ids"]
    assert "".join(e.text for e in events) == expected["text"] and events[-1].finish_reason == "stop"


def test_a_stop_token_in_the_prompt_stops_nothing_through_chunks_and_async(ckpt, plain):
    """A prompt token that is a stop id does not end the request (chunked prefill, async steps)."""
    prompt_ids = LLM(ckpt, **ENGINE).tokenizer.encode(PROMPTS[2])
    for async_scheduling in (True, False):
        chunked = LLM(ckpt, **ENGINE, max_num_batched_tokens=2, async_scheduling=async_scheduling)
        out = chunked.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=MAX,
                                                          ignore_eos=True,
                                                          stop_token_ids=prompt_ids[:2]),
                               use_tqdm=False)[0]
        expected = plain[2]["token_ids"]
        stops = [i for i, t in enumerate(expected) if t in prompt_ids[:2]]
        assert out["token_ids"] == expected[:stops[0] + 1] if stops else expected
        assert out["finish_reason"] == ("stop" if stops else "length")
        chunked.close()
