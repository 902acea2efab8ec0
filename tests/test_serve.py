"""The OpenAI-compatible server (chapter 15), driven as a real process by the official openai client on CPU."""
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nanoengine import LLM, SamplingParams
from nanoengine.models.checkpoint import write_random_checkpoint
from nanoengine.utils.dist import free_port

ENGINE_FLAGS = ["--device", "cpu", "--max-model-len", "512", "--kvcache-block-size", "16",
                "--num-kvcache-blocks", "256", "--max-num-seqs", "64"]
ENGINE_KWARGS = dict(device="cpu", max_model_len=512, kvcache_block_size=16, num_kvcache_blocks=256,
                     max_num_seqs=64)
MODEL = "tiny"  # --served-model-name


def start_server(ckpt: Path, log: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`python -m nanoengine.serve` on a free port; returns the process and its base URL once /health answers."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    with open(log, "w") as out:  # a file, not a pipe: a full pipe would block the server
        proc = subprocess.Popen([sys.executable, "-m", "nanoengine.serve", str(ckpt), "--port", str(port),
                                 "--served-model-name", MODEL, *ENGINE_FLAGS, *flags],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"the server did not start:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    proc, url = start_server(ckpt, tmp_path_factory.mktemp("log") / "server.log")
    yield proc, url
    stop(proc)


@pytest.fixture(scope="module")
def url(server) -> str:
    return server[1]


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(ckpt) -> LLM:
    return LLM(ckpt, **ENGINE_KWARGS)


def stats(url: str, since_step: int = 0) -> dict:
    return httpx.get(f"{url}/stats", params={"since_step": since_step}, timeout=30).json()


def wait_all_blocks_free(url: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = stats(url)
        if (s["num_free_blocks"] == s["num_blocks"] and not s["num_running"] and not s["num_waiting"]) \
                or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


PROMPTS = ["Hello, my name is", "The capital of France is", [5, 17, 99, 3, 250], "a"]
GREEDY = SamplingParams(temperature=0, max_tokens=20)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


def test_health_and_models(client, url):
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].object == "model"


def test_greedy_completions_equal_generate(client, llm):
    expected = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    got = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=20, temperature=0)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [e["text"] for e in expected]
    assert [c.finish_reason for c in got.choices] == [e["finish_reason"] for e in expected]
    assert got.usage.prompt_tokens == sum(len(e["prompt_token_ids"]) for e in expected)
    assert got.usage.completion_tokens == sum(len(e["token_ids"]) for e in expected)
    for prompt, e in zip(PROMPTS, expected):
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                                stream=True))
        assert "".join(c.choices[0].text for c in chunks) == e["text"]
        assert [c.choices[0].finish_reason for c in chunks][-1] == e["finish_reason"]


def test_greedy_chat_equals_llm_chat(client, llm):
    expected = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    got = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == expected["text"]
    assert got.choices[0].finish_reason == expected["finish_reason"]
    assert got.usage.completion_tokens == len(expected["token_ids"])
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["text"]
    assert chunks[-1].usage.completion_tokens == len(expected["token_ids"]) and not chunks[-1].choices


def test_stop_strings_cut_the_text_and_never_stream_a_partial_stop(client, llm):
    full = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=40,
                                                             ignore_eos=True), use_tqdm=False)[0]["text"]
    cut = next(k for k in range(6, len(full) - 3) if full.find(full[k:k + 3]) == k)  # a 3-character stop
    stop = full[cut:cut + 3]
    kwargs = dict(model=MODEL, prompt="Hello, my name is", max_tokens=40, temperature=0, stop=[stop, "never"],
                  extra_body={"ignore_eos": True})
    expected = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                                 stop=[stop, "never"]), use_tqdm=False)[0]
    assert (expected["text"], expected["finish_reason"]) == (full[:cut], "stop")
    whole = client.completions.create(**kwargs)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected["text"], "stop")
    assert whole.usage.completion_tokens == len(expected["token_ids"])  # the token that completed the stop too
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(expected["token_ids"])
    assert not any(stop in c.choices[0].text for c in chunks if c.choices)


def test_stop_token_ids_through_the_official_client(client, llm):
    plain = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                         use_tqdm=False)[0]
    token = plain["token_ids"][4]
    stop_at = plain["token_ids"].index(token) + 1
    expected = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                       stop_token_ids=[token]), use_tqdm=False)[0]
    assert expected["token_ids"] == plain["token_ids"][:stop_at]
    extra = {"ignore_eos": True, "stop_token_ids": [token]}
    got = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0,
                                    extra_body=extra)
    assert (got.choices[0].text, got.choices[0].finish_reason) == (expected["text"], "stop")
    assert got.usage.completion_tokens == stop_at
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20,
                                            temperature=0, stream=True, extra_body=extra))
    assert "".join(c.choices[0].text for c in chunks) == expected["text"]
    assert chunks[-1].choices[0].finish_reason == "stop"
    for bad in ([-1], "7", [2**40], [0.5]):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                      extra_body={"stop_token_ids": bad})
        assert e.value.body["param"] == "stop_token_ids"


def test_logprobs_penalties_and_min_tokens_equal_generate(client, llm):
    """The sampling extras on the tiny model (tests/test_serve_sampling.py covers them on SmolLM2)."""
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, presence_penalty=1.0, repetition_penalty=1.3,
                            min_tokens=8)
    expected = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2,
                                    presence_penalty=1.0, extra_body={"repetition_penalty": 1.3, "min_tokens": 8})
    assert got.choices[0].text == expected["text"] and got.usage.completion_tokens == 8
    assert all(abs(a - e.logprob) < 1e-4 for a, e in zip(got.choices[0].logprobs.token_logprobs,
                                                          expected["logprobs"], strict=True))
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2, frequency_penalty=-1.0)
    assert [len(t.top_logprobs) for t in chat.choices[0].logprobs.content] == [2] * chat.usage.completion_tokens


def test_n_and_seeded_sampling(client):
    kwargs = dict(model=MODEL, prompt="Once", max_tokens=12, temperature=1.0, top_p=0.9, seed=7, n=3,
                  extra_body={"top_k": 50})
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert sorted(c.index for c in first.choices) == [0, 1, 2]


BAD = [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": 0}, "top_k"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "seed": -3}, "seed"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "stop": ["a", 3]}, "stop"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "min_tokens": 17}, "min_tokens"),
    ({"prompt": "x", "top_logprobs": 2}, "top_logprobs"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({"prompt": 3}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, 2, 10**9]}, "prompt"),
    ({"prompt": "word " * 600}, "prompt"),
    ({"prompt": "x", "max_tokens": 600}, "prompt"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}, "max_completion_tokens"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_requests_get_400_naming_the_field(url, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    for stream in (False, True):
        r = httpx.post(url + path, json={"model": MODEL, **body, **({"stream": True} if stream else {})},
                       timeout=30)
        if param == "stream" and stream:
            continue
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["param"] == param, error
        assert error["message"]


def test_unknown_model_404_and_other_errors(url, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x")
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert httpx.get(url + "/v2/nothing").status_code == 404
    assert client.completions.create(model=MODEL, prompt="still serving", max_tokens=2).choices[0].text is not None
    assert wait_all_blocks_free(url)["num_free_blocks"] == 256


async def stream_tokens(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> tuple[str, str]:
    text, reason = "", None
    async for chunk in await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                       temperature=0, stream=True,
                                                       extra_body={"ignore_eos": True}):
        text += chunk.choices[0].text
        reason = chunk.choices[0].finish_reason or reason
    return text, reason


def test_32_concurrent_streams_share_decode_steps(url, llm):
    prompts = [f"Request number {i} says" for i in range(32)]
    before = stats(url)["num_steps"]

    async def run():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as aclient:
            return await asyncio.gather(*(stream_tokens(aclient, p, 96) for p in prompts))

    results = asyncio.run(run())
    expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=96, ignore_eos=True), use_tqdm=False)
    assert [r[0] for r in results] == [e["text"] for e in expected]
    assert {r[1] for r in results} == {"length"}
    s = stats(url, since_step=before)
    assert s["max_decode_batch"] >= 24, s  # the streams ran in the same decode steps, not one after another
    assert s["num_decode_steps"] < 4 * 96, s
    assert wait_all_blocks_free(url)["num_free_blocks"] == s["num_blocks"]


def test_a_disconnecting_client_is_aborted_and_frees_its_blocks(url):
    before = stats(url)["num_steps"]
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 480, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(8)]
    assert any(line.startswith("data: {") for line in got)
    s = wait_all_blocks_free(url)
    assert s["num_free_blocks"] == s["num_blocks"] and s["num_running"] == 0
    assert s["num_steps"] - before < 480, "the request was aborted, not run to its 480 tokens"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def load(url: str, num_requests: int, num_clients: int, seed: int) -> list[int]:
    """`num_requests` mixed requests from `num_clients` concurrent clients; returns their HTTP statuses."""
    rng = random.Random(seed)
    todo = list(range(num_requests))
    statuses = []

    async def client_task(http: httpx.AsyncClient) -> None:
        while todo:
            i = todo.pop()
            body = {"model": MODEL, "prompt": f"load {i} " * rng.randint(1, 20), "max_tokens": rng.randint(1, 12),
                    "temperature": rng.choice([0, 0.8]), "stream": i % 2 == 0}
            if i % 7 == 0:
                body["max_tokens"] = 0  # a bad request now and then
            async with http.stream("POST", "/v1/completions", json=body) as r:
                lines = [line async for line in r.aiter_lines() if line]
            statuses.append(r.status_code)
            if r.status_code == 200 and body["stream"]:
                assert lines[-1] == "data: [DONE]"

    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        await asyncio.gather(*(client_task(http) for _ in range(num_clients)))
    return statuses


def test_load_leaks_no_blocks_and_no_memory(server):
    proc, url = server
    asyncio.run(load(url, 200, 32, seed=0))  # warm up: allocator pools, caches, connection handling
    rss_before = rss_bytes(proc.pid)
    t0 = time.perf_counter()
    statuses = asyncio.run(load(url, 1000, 32, seed=1))
    seconds = time.perf_counter() - t0
    rss_growth = rss_bytes(proc.pid) - rss_before
    print(f"1000 requests from 32 clients in {seconds:.1f} s; server RSS grew {rss_growth / 2**20:.1f} MiB")
    assert statuses.count(400) == len([i for i in range(1000) if i % 7 == 0])
    assert statuses.count(200) == 1000 - statuses.count(400)
    s = wait_all_blocks_free(url)
    assert s["num_free_blocks"] == s["num_blocks"] and s["num_running"] == s["num_waiting"] == 0
    assert rss_growth < 40 * 2**20, f"server memory grew {rss_growth / 2**20:.1f} MiB over 1000 requests"
    assert httpx.get(url + "/health").status_code == 200


def spawned_children(pid: int) -> list[int]:
    """Live spawned processes (multiprocessing's `spawn_main`) whose parent is `pid`, zombies left out."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            spawned = b"spawn_main" in (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and spawned:
            found.append(int(stat.parent.name))
    return found


def spawned_descendants(pid: int) -> list[int]:
    """The spawned processes below `pid`: the engine's process, and its tensor-parallel workers."""
    children = spawned_children(pid)
    return children + [d for c in children for d in spawned_descendants(c)]


def test_sigterm_stops_the_server_its_engine_and_its_tensor_parallel_workers(ckpt, tmp_path):
    proc, url = start_server(ckpt, tmp_path / "tp.log", "--tensor-parallel-size", "2")
    engine = spawned_children(proc.pid)
    assert len(engine) == 1, "the engine runs in a process of its own"
    workers = spawned_children(engine[0])
    assert len(workers) == 1, "the second rank runs in a child process of the engine's"
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    stream = client.completions.create(model=MODEL, prompt="forever", max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # a request is in flight
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=15)
    finally:
        stop(proc)
    seconds = time.monotonic() - t0
    assert code == 0, (tmp_path / "tp.log").read_text()[-3000:]
    assert seconds < 10, f"SIGTERM took {seconds:.1f} s"
    deadline = time.monotonic() + 5
    left = engine + workers
    while any(Path(f"/proc/{p}").exists() for p in left) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{p}").exists() for p in left), "a process outlived the server"
    stream.close()


def test_a_killed_engine_process_fails_open_requests_and_health_but_not_the_server(ckpt, tmp_path):
    proc, url = start_server(ckpt, tmp_path / "killed.log")
    try:
        [engine] = spawned_children(proc.pid)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(model=MODEL, prompt="forever", max_tokens=400, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)  # a request is in flight
        os.kill(engine, signal.SIGKILL)  # as the out-of-memory killer would
        t0 = time.monotonic()
        with pytest.raises(openai.APIError):  # the stream ends with an error event, not a hang
            for _ in chunks:
                pass
        assert time.monotonic() - t0 < 10
        assert httpx.get(url + "/health", timeout=5).status_code == 503
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                       timeout=10)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert time.monotonic() - t0 < 2
        assert proc.poll() is None, "the server stays up to answer (and report) the failure"
    finally:
        stop(proc)


def test_a_host_header_that_names_another_machine_is_421(client, url):
    """DNS rebinding: a page of evil.example whose name now points at 127.0.0.1 still sends its own Host."""
    port = url.rsplit(":", 1)[1]
    rebound = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30,
                            default_headers={"Host": f"evil.example:{port}"})
    with pytest.raises(openai.APIStatusError) as e:
        rebound.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert e.value.status_code == 421 and e.value.body["code"] == "misdirected_request"
    for path in ("/health", "/v1/models", "/metrics", "/stats"):
        r = httpx.get(url + path, headers={"Host": "evil.example"}, timeout=30)
        assert r.status_code == 421 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "api.localhost"):
        assert httpx.get(url + "/v1/models", headers={"Host": host}, timeout=30).status_code == 200
    assert client.models.list().data[0].id == MODEL  # the client's own Host, 127.0.0.1:port


def test_tokenize_and_detokenize(client, url, llm):
    text = httpx.post(url + "/tokenize", json={"prompt": "Hello, my name is", "return_token_strs": True},
                      timeout=30).json()
    ids = llm.tokenizer.encode("Hello, my name is")
    assert text == {"count": len(ids), "max_model_len": 512, "tokens": ids,
                    "token_strs": llm.tokenizer.convert_ids_to_tokens(ids)}
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    counted = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": MESSAGES}, timeout=30).json()
    assert counted["count"] == chat.usage.prompt_tokens and "token_strs" not in counted
    expected = llm.chat(MESSAGES, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert counted["tokens"] == expected["prompt_token_ids"]
    bare = httpx.post(url + "/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False},
                      timeout=30).json()
    assert bare["count"] < counted["count"] and counted["tokens"][:bare["count"]] == bare["tokens"]
    back = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": ids}, timeout=30).json()
    assert back == {"prompt": "Hello, my name is"}
    assert httpx.post(url + "/detokenize", json={"tokens": []}, timeout=30).json() == {"prompt": ""}


TOKENIZE_BAD = [
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, 400, "add_generation_prompt"),
    ("/tokenize", {"prompt": "x", "truncate": 3}, 400, "truncate"),
    ("/tokenize", {"prompt": "x" * 10_000}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0]"),
    ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 384]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, 400, "skip_special_tokens"),
]


@pytest.mark.parametrize("path,body,status,param", TOKENIZE_BAD, ids=[f"{p}-{i}" for i, (_, _, _, p)
                                                                     in enumerate(TOKENIZE_BAD)])
def test_tokenize_refusals_are_openai_errors(url, path, body, status, param):
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def metric(url: str, name: str, labels: tuple = ()) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}.get((name, labels), 0.0)


def wait_metric(url: str, name: str, labels: tuple, expected: float) -> None:
    """A streamed request is counted when the server has closed its response: poll briefly."""
    deadline = time.monotonic() + 5
    while metric(url, name, labels) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric(url, name, labels) == expected, (name, labels, metric(url, name, labels), expected)


def test_metrics_count_outcomes_latencies_and_the_engine(client, url):
    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    outcome = {o: ("nanoengine:requests_total", (("outcome", o),)) for o in
               ("finished", "rejected", "failed", "cancelled")}
    before = {o: metric(url, *key) for o, key in outcome.items()}
    ttft_before = metric(url, "nanoengine:time_to_first_token_seconds_count")
    sums_before = {name: metric(url, f"nanoengine:{name}_seconds_sum")
                   for name in ("time_to_first_token", "request_queue_time", "request_prefill_time")}
    itl_before = metric(url, "nanoengine:inter_token_latency_seconds_count")
    tokens_before = metric(url, "nanoengine:generation_tokens_total")
    whole = client.completions.create(model=MODEL, prompt="count me", max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert len(list(client.completions.create(model=MODEL, prompt="and me", max_tokens=20, stream=True,
                                              extra_body={"ignore_eos": True}))) >= 1
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(lines)  # running: the engine's gauges say so
        assert metric(url, "nanoengine:num_requests_running") == 1
        assert 0 < metric(url, "nanoengine:kv_cache_usage_perc") < 1
    wait_metric(url, *outcome["cancelled"], before["cancelled"] + 1)
    wait_metric(url, *outcome["finished"], before["finished"] + 2)
    assert metric(url, *outcome["rejected"]) == before["rejected"] + 1
    assert metric(url, *outcome["failed"]) == before["failed"]
    assert metric(url, "nanoengine:time_to_first_token_seconds_count") == ttft_before + 3
    for name in ("request_queue_time", "request_prefill_time"):  # the engine timed each first token
        assert metric(url, f"nanoengine:{name}_seconds_count") == ttft_before + 3
    spent = {name: metric(url, f"nanoengine:{name}_seconds_sum") - before
             for name, before in sums_before.items()}
    assert 0 < spent["request_queue_time"] + spent["request_prefill_time"] < spent["time_to_first_token"]
    generated = metric(url, "nanoengine:generation_tokens_total") - tokens_before
    assert generated >= 40 + 1 and whole.usage.completion_tokens == 20
    gaps = metric(url, "nanoengine:inter_token_latency_seconds_count") - itl_before
    assert 2 * 19 - 2 <= gaps <= generated - 3  # one a token after each request's first
    s = wait_all_blocks_free(url)
    assert s["num_running"] == 0
    assert metric(url, "nanoengine:num_requests_running") == metric(url, "nanoengine:kv_cache_usage_perc") == 0


def read_events(r: httpx.Response) -> list[str]:
    return [line for line in r.iter_lines() if line]


def test_shutdown_timeout_drains_requests_in_flight_then_stops_the_rest(ckpt, tmp_path):
    """--shutdown-timeout: SIGTERM stops accepting, lets what is in flight finish for up to S seconds, then fails it."""
    servers = {}
    for name, seconds in (("drain", "20"), ("cut", "1")):  # started side by side: both load at once
        port = free_port()
        log = open(tmp_path / f"{name}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "nanoengine.serve", str(ckpt), "--port", str(port),
                                 "--served-model-name", MODEL, *ENGINE_FLAGS, "--shutdown-timeout", seconds],
                                stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
        servers[name] = (proc, f"http://127.0.0.1:{port}")
    try:
        for proc, url in servers.values():
            deadline = time.monotonic() + 120
            while not healthy(url):
                assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
        # a request that finishes within the drain: it ends normally, and nothing new gets in meanwhile
        proc, url = servers["drain"]
        body = {"model": MODEL, "prompt": "finish", "max_tokens": 60, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):
                httpx.get(url + "/health", timeout=2)
            rest = [line for line in lines if line]
        assert proc.wait(timeout=20) == 0 and time.monotonic() - t0 < 15
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        # 64 sequences of 480 tokens, eight at a time in the KV cache: far more than one second's work
        proc, url = servers["cut"]
        body = {"model": MODEL, "prompt": "forever", "max_tokens": 480, "n": 64, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        stopped = time.monotonic() - t0
        assert proc.wait(timeout=20) == 0
        assert rest[-1] == "data: [DONE]" and "shutting down" in json.loads(rest[-2][6:])["error"]["message"]
        assert 0.9 < stopped < 8, f"the stream ended {stopped:.1f} s after SIGTERM"
    finally:
        for proc, _ in servers.values():
            stop(proc)


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
