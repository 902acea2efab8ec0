"""Section 11.5's prompt graphs on a CPU: the buckets, the attention hook's cut, and where the runner leaves them
out. Capturing and replaying them is checked on the GPU (tests/test_gpu.py)."""
import pytest
import torch

from nanoengine import LLM
from nanoengine.config import Optimizations
from nanoengine.engine.prompt_graphs import PromptGraphs, prompt_bucket, prompt_buckets
from nanoengine.layers.attention import Attention
from nanoengine.models.checkpoint import write_random_checkpoint
from nanoengine.models.qwen3 import Qwen3ForCausalLM
from nanoengine.utils.context import StepContext, bind_step_context


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("pg") / "tiny", "tiny", seed=3)


def test_buckets_are_fine_where_padding_costs_and_end_at_the_limit():
    b = prompt_buckets(2048)
    assert b[:3] == [16, 32, 64] and all(y - x == 64 for x, y in zip(b[2:18], b[3:18])) and b[17] == 1024
    assert b[18:] == [1280, 1536, 1792, 2048]
    assert prompt_buckets(300) == [16, 32, 64, 128, 192, 256, 300] and prompt_buckets(16) == [16]
    for n in range(1, 2049):
        size = prompt_bucket(b, n)
        assert size >= n and size - n < (64 if n <= 1024 else 256)
    for bad in (0, 2049):
        with pytest.raises(ValueError, match=f"{bad} tokens does not fit the captured sizes 1..2048"):
            prompt_bucket(b, bad)
    with pytest.raises(TypeError):
        prompt_buckets(64.0)


def test_the_hook_cuts_each_attention_call_and_padding_rows_leave_the_real_rows_alone(ckpt):
    """What a replay computes, without a graph: attention on the first n rows only, the rest padded arbitrarily."""
    model = Qwen3ForCausalLM.from_pretrained(ckpt)
    step = StepContext()
    bind_step_context(model, step)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    calls = []

    def hook(layer, q, k, v, kv_stored):
        calls.append(layer)
        layer.graph_break = None
        try:
            out = torch.full_like(q, 1e4)  # padding rows: anything finite
            out[:n] = layer(q[:n], k[:n], v[:n], kv_stored)
        finally:
            layer.graph_break = hook
        return out

    g = torch.Generator().manual_seed(1)
    n, padded = 21, 48
    ids = torch.randint(0, 100, (padded,), generator=g)
    pos = torch.cat([torch.arange(n), torch.randint(0, 90, (padded - n,), generator=g)])
    step.set(is_prefill=True, cu_seqlens_q=torch.tensor([0, n]), cu_seqlens_k=torch.tensor([0, n]))
    with torch.inference_mode():
        plain = model(ids[:n], pos[:n])
        for layer in layers:
            layer.graph_break = hook
        try:
            cut = model(ids, pos)
        finally:
            for layer in layers:
                layer.graph_break = None
    assert calls == layers, "one cut per attention layer, in the model's order"
    assert cut.shape == (padded, plain.shape[1])
    torch.testing.assert_close(cut[:n], plain, atol=1e-5, rtol=1e-5)


def test_prompt_graphs_need_a_gpu_and_a_cpu_engine_has_none(ckpt):
    model = Qwen3ForCausalLM.from_pretrained(ckpt)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        PromptGraphs(model, max_tokens=64, hidden_size=64, dtype=torch.float32, device=torch.device("cpu"))
    llm = LLM(ckpt, device="cpu", num_kvcache_blocks=16, kvcache_block_size=16, max_model_len=128)
    assert llm.model_runner.prompt_graphs is None
    assert Optimizations().prompt_graphs and Optimizations(prompt_graphs=False).off() == ["prompt_graphs"]
    with pytest.raises(ValueError, match="optimizations.prompt_graphs"):
        Optimizations(prompt_graphs=1)
    llm.close()
