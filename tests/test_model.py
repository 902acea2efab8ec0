"""Qwen3 model, checkpoint writer and loader (chapter 05): logits against transformers, loader errors, paths."""
import itertools
import time

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoConfig, AutoTokenizer, GenerationConfig  # noqa: E402
from transformers import Qwen2ForCausalLM as HFQwen2  # noqa: E402
from transformers import Qwen3ForCausalLM as HFQwen3  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from nanoengine.layers.attention import Attention, varlen_causal_attention  # noqa: E402
from nanoengine.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from nanoengine.models.checkpoint import (PRESETS, TOKENIZER_VOCAB_SIZE, qwen3_config,  # noqa: E402
                                         write_random_checkpoint)
from nanoengine.utils.context import reset_context, set_context  # noqa: E402
from nanoengine.models.loader import load_model, resolve_model_path  # noqa: E402

hf_logging.disable_progress_bar()
FP32_TOL, BF16_TOL = 1e-5, 5e-2          # max |ours - hf| / max |logit|; measured ~4e-7 and ~2e-2 (see chapter 05)
TEXTS = ["Hello", "The scheduler builds each batch.", "a",
         "Each layer normalises its input, mixes information between tokens with attention, and transforms every token."]


def cu_of(lengths) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


@torch.no_grad()
def our_logits(model, prompts):
    """Logits of every packed token, and the prefill head's last-token logits."""
    input_ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    cu, longest = cu_of([len(p) for p in prompts]), max(len(p) for p in prompts)
    set_context(is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
    try:
        hidden = model(input_ids, positions)
        last = model.compute_logits(hidden)
    finally:
        reset_context()
    return model.compute_logits(hidden).float(), last.float()


@torch.no_grad()
def reference_logits(hf_model, prompts):
    return torch.cat([hf_model(input_ids=torch.tensor([p])).logits[0].float() for p in prompts])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def prompts(tiny):
    tok = AutoTokenizer.from_pretrained(tiny)
    return [tok.encode(t) for t in TEXTS]


# ---------------------------------------------------------------- logits against transformers
CASES = [(dtype, "qwen3", tie, bias) for dtype in (torch.float32, torch.bfloat16)
         for tie in (True, False) for bias in (False, True)]
CASES += [(dtype, "qwen2", tie, None) for dtype in (torch.float32, torch.bfloat16) for tie in (True, False)]


@pytest.mark.parametrize("dtype,model_type,tie,bias", CASES,
                         ids=[f"{str(d)[6:]}-{m}-tied={t}-bias={b}" for d, m, t, b in CASES])
def test_logits_match_transformers(tmp_path, prompts, dtype, model_type, tie, bias):
    config = {**PRESETS["tiny"], "model_type": model_type}
    path = write_random_checkpoint(tmp_path, config, dtype=dtype, tie_word_embeddings=tie, attention_bias=bias)
    hf_class = HFQwen2 if model_type == "qwen2" else HFQwen3
    hf = hf_class.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=dtype)
    assert next(model.parameters()).dtype == dtype
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    ours, last = our_logits(model, prompts)
    ref = reference_logits(hf, prompts)
    scale = ref.abs().max().item()
    assert scale > 1.0                                    # logits of order one: the comparison is sensitive
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    assert (last - ours[cu_of([len(p) for p in prompts])[1:] - 1]).abs().max().item() <= tol * scale
    assert (ours - ref).abs().max().item() <= tol * scale


def test_packing_is_invisible(tiny, prompts):
    model = Qwen3ForCausalLM.from_pretrained(tiny)
    alone = torch.cat([our_logits(model, [p])[0] for p in prompts])
    packed, _ = our_logits(model, prompts)
    merged, _ = our_logits(model, [[t for p in prompts for t in p]])
    assert (alone - packed).abs().max() < 1e-5
    assert (alone - merged).abs().max() > 0.1             # ignoring the boundaries is visible


def test_optimizations_reach_the_modules_that_choose_a_path(tiny, prompts):
    """Each decoder layer knows prologue_kernels and each attention block fused_rope_store from construction; on a CPU
    neither changes a logit, and the CPU tuning measures nothing."""
    from nanoengine.config import Optimizations
    from nanoengine.kernels.fused import fusion_pairs, tune_kernels
    off = Optimizations(prologue_kernels=False, fused_rope_store=False)
    plain = Qwen3ForCausalLM.from_pretrained(tiny, optimizations=off)
    assert all(not layer.prologue_kernels and not layer.self_attn.fused_rope_store for layer in plain.model.layers)
    model = Qwen3ForCausalLM.from_pretrained(tiny)
    assert all(layer.prologue_kernels and layer.self_attn.fused_rope_store for layer in model.model.layers)
    assert torch.equal(our_logits(plain, prompts)[0], our_logits(model, prompts)[0])
    built = Qwen3ForCausalLM.build(qwen3_config("tiny"), optimizations=off)
    assert not built.model.layers[-1].prologue_kernels
    assert len(model.linear_weights()) == 4 * len(model.model.layers)
    assert [prologue for prologue, _, _ in fusion_pairs(model)[:3]] == ["norm", "add_norm", "silu"]
    assert tune_kernels(model, Optimizations()) == {"gemv": {}, "fusions": {}}


# ---------------------------------------------------------------- attention
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_attention_matches_sdpa(dtype, tol):
    torch.manual_seed(0)
    lens_q, lens_k = [5, 1, 3, 7], [5, 1, 6, 9]
    q = torch.randn(sum(lens_q), 4, 16, dtype=dtype)
    k, v = torch.randn(2, sum(lens_k), 2, 16, dtype=dtype)
    out = varlen_causal_attention(q, k, v, cu_of(lens_q), cu_of(lens_k), 0.25)
    q0 = k0 = 0
    for nq, nk in zip(lens_q, lens_k):
        qs = q[q0:q0 + nq].transpose(0, 1).float()
        ks, vs = (x[k0:k0 + nk].transpose(0, 1).float().repeat_interleave(2, 0) for x in (k, v))
        mask = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
        ref = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=0.25).transpose(0, 1)
        torch.testing.assert_close(out[q0:q0 + nq], ref.to(dtype), atol=tol, rtol=0)
        q0, k0 = q0 + nq, k0 + nk
    attn = Attention(4, 16, 0.25, 2)
    assert attn.k_cache.numel() == 0 and attn.v_cache.numel() == 0
    reset_context()
    with pytest.raises(RuntimeError, match="set_context"):
        attn(q, k[:len(q)], v[:len(q)])


# ---------------------------------------------------------------- loader errors
def _damaged(tiny, target, edit):
    target.mkdir()
    (target / "config.json").write_text((tiny / "config.json").read_text())
    tensors = load_file(tiny / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors")
    return target


def _load_error(path, config_path=None, **overrides) -> str:
    config = qwen3_config(AutoConfig.from_pretrained(config_path or path), **overrides)
    with pytest.raises(ValueError) as info:
        load_model(Qwen3ForCausalLM(config), path)
    return str(info.value)


K1 = "model.layers.1.self_attn.k_proj.weight"


def test_loader_missing_tensor(tiny, tmp_path):
    msg = _load_error(_damaged(tiny, tmp_path / "m", lambda t: t.pop(K1)))
    assert f"missing tensors: {K1}" in msg


def test_loader_unexpected_tensor(tiny, tmp_path):
    msg = _load_error(_damaged(tiny, tmp_path / "u", lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.ones(2)})))
    assert "unexpected tensors: model.layers.0.mlp.extra.weight" in msg


def test_loader_shape_mismatch(tiny, tmp_path):
    msg = _load_error(_damaged(tiny, tmp_path / "s", lambda t: t.update({"model.norm.weight": torch.ones(65)})))
    assert "model.norm.weight (65,)" in msg and "(64,)" in msg
    msg = _load_error(_damaged(tiny, tmp_path / "q", lambda t: t.update({K1: torch.ones(1, 64)})))
    assert f"{K1} (1, 64)" in msg                          # would broadcast silently in a plain copy_
    msg = _load_error(_damaged(tiny, tmp_path / "o", lambda t: t.update(
        {"model.layers.0.self_attn.o_proj.weight": torch.ones(64, 48)})))
    assert "model.layers.0.self_attn.o_proj.weight (64, 48)" in msg


def test_loader_tied_and_untied_heads(tiny, tmp_path):
    assert "missing tensors: lm_head.weight" in _load_error(tiny, tie_word_embeddings=False)
    with_head = _damaged(tiny, tmp_path / "h", lambda t: t.update({"lm_head.weight": torch.zeros(384, 64)}))
    model = Qwen3ForCausalLM(AutoConfig.from_pretrained(tiny))
    load_model(model, with_head)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, load_file(tiny / "model.safetensors")["model.embed_tokens.weight"])
    untied = write_random_checkpoint(tmp_path / "untied", tie_word_embeddings=False)
    model = Qwen3ForCausalLM.from_pretrained(untied)
    stored = load_file(untied / "model.safetensors")
    assert torch.equal(model.lm_head.weight, stored["lm_head.weight"])
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_loader_no_weights(tmp_path, tiny):
    with pytest.raises(OSError, match="safetensors"):
        load_model(Qwen3ForCausalLM(AutoConfig.from_pretrained(tiny)), tmp_path)


# ---------------------------------------------------------------- paths
def test_resolve_model_path(tiny, tmp_path, monkeypatch):
    assert resolve_model_path(tiny) == tiny
    assert resolve_model_path(str(tiny)) == tiny
    with pytest.raises(OSError, match="config.json"):
        resolve_model_path(tmp_path)
    with pytest.raises(OSError, match="is a file"):
        resolve_model_path(tiny / "config.json")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    for bad in ["nanoengine-tests/no-such-model", str(tmp_path / "missing"), "not/a/valid/id/at/all"]:
        with pytest.raises(OSError, match="neither a local directory nor a model id"):
            resolve_model_path(bad)
    assert time.perf_counter() - t0 < 5
    with pytest.raises(TypeError):
        resolve_model_path(None)


# ---------------------------------------------------------------- checkpoint writer
def test_checkpoint_round_trip(tiny):
    names = {p.name for p in tiny.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    config = AutoConfig.from_pretrained(tiny)
    tok = AutoTokenizer.from_pretrained(tiny)
    assert len(tok) == TOKENIZER_VOCAB_SIZE <= config.vocab_size
    assert config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert config.pad_token_id == tok.pad_token_id
    assert GenerationConfig.from_pretrained(tiny).eos_token_id == config.eos_token_id
    text = "Packed prompts, ünïcode and 🚀 round-trip."
    assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_checkpoint_is_seeded(tmp_path):
    a = load_file(write_random_checkpoint(tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(write_random_checkpoint(tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(write_random_checkpoint(tmp_path / "c", seed=4) / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    norm = a["model.layers.0.input_layernorm.weight"]
    assert not torch.allclose(norm, torch.ones_like(norm))     # norms are random too, so swaps are detectable


def test_checkpoint_bad_input(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        write_random_checkpoint(tmp_path / "x", "qwen3-7b")
    with pytest.raises(ValueError, match="vocab_size"):
        write_random_checkpoint(tmp_path / "x", vocab_size=10)
    with pytest.raises(ValueError, match="model_type"):
        write_random_checkpoint(tmp_path / "x", {"model_type": "mistral"})
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError, match="not a directory"):
        write_random_checkpoint(tmp_path / "file")


def test_qwen3_0_6b_preset_numbers():
    c = qwen3_config("qwen3-0.6b")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == \
        (1024, 28, 16, 8, 128)
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (3072, 151_936, 40_960)
    assert c.tie_word_embeddings and c.dtype == torch.bfloat16 and c.rms_norm_eps == 1e-6
    assert c.rope_parameters["rope_theta"] == 1_000_000
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)            # torch.empty parameters: allocated lazily, never touched
    try:
        model = Qwen3ForCausalLM(c)
    finally:
        torch.set_default_dtype(previous)
    assert sum(p.numel() for p in model.parameters()) == 596_049_920
