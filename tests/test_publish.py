"""The engine loop's `publish` (chapter 15) on a tiny random checkpoint (CPU): a long streamed reply with a stop
string is searched for it once per character, not once per character per step."""
from nanoengine import LLM, SamplingParams
from nanoengine.models.checkpoint import write_random_checkpoint
from nanoengine.serving import engine_loop
from nanoengine.serving.engine_loop import LiveRequest, Submission, admit, publish


def test_a_long_reply_is_searched_for_its_stop_string_once_per_character(monkeypatch, tmp_path):
    calls = []  # (the text's length, where the search started) of each search publish makes
    real = engine_loop.find_stop

    def spy(text: str, stop: tuple[str, ...], start: int = 0, floor: int = 0) -> int:
        calls.append((len(text), start))
        return real(text, stop, start, floor)

    monkeypatch.setattr(engine_loop, "find_stop", spy)
    stop = ("<never here>",)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, stop=stop)
    ckpt = write_random_checkpoint(tmp_path / "tiny", "tiny", seed=0)
    with LLM(ckpt, device="cpu", max_model_len=512) as llm:
        events = []
        request = LiveRequest(admit(llm, Submission(["Once upon a time"], params)), events.append,
                              llm.tokenizer)
        while not publish(llm, request):
            llm.step()
        want = llm.generate(["Once upon a time"], params, use_tqdm=False)[0]["text"]
    text = "".join(e.text for e in events)
    assert text == want and len(text) > 400
    assert len(calls) > 100  # one search per step with new text
    overlap = len(stop[0]) - 1  # a stop string may begin this far back in the text searched before
    searched = sum(n - start for n, start in calls)
    assert searched <= len(text) + overlap * len(calls), (searched, len(text), len(calls))
