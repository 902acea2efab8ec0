"""Checks of chapter 04's layers: world size 1 in this process, world size 2 over gloo in spawned processes."""
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanoengine.layers.linear as linear_mod
from nanoengine.layers.activation import SiluAndMul
from nanoengine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanoengine.layers.layernorm import RMSNorm
from nanoengine.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                      ReplicatedLinear, RowParallelLinear, divide)
from nanoengine.layers.rotary_embedding import get_rope
from nanoengine.utils.compile import compile_stance, maybe_compile
from nanoengine.utils.context import Context, get_context, reset_context, set_context
from nanoengine.utils.dist import all_reduce, run_tp_workers, shard_and_run, tp_rank, tp_size

TOL = dict(atol=1e-5, rtol=1e-5)


def _run_jobs(jobs: list[tuple]) -> list:
    """Run several shard_and_run jobs on one rank (so one spawn serves several checks)."""
    return [shard_and_run(*job) for job in jobs]


def _load(layer: nn.Module, name: str, tensor: torch.Tensor, shard_id=None) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor, shard_id)


def test_context_and_rank_helpers_without_process_group():
    set_context(is_prefill=True, cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32), max_seqlen_q=2)
    assert get_context().is_prefill and get_context().max_seqlen_q == 2
    reset_context()
    assert get_context() == Context()
    assert (tp_rank(), tp_size()) == (0, 1)
    x = torch.ones(3)
    assert all_reduce(x) is x and x.tolist() == [1.0, 1.0, 1.0]


def test_maybe_compile_never_compiles_on_cpu():
    fn = maybe_compile(lambda t: t * 2)
    assert fn(torch.ones(2)).tolist() == [2.0, 2.0] and fn.compiled is None


def test_compile_stance_off_runs_compiled_functions_eagerly():
    traced = []
    fn = torch.compile(lambda t: t * 2, backend=lambda gm, inputs: traced.append(gm) or gm.forward)
    with compile_stance(False):
        assert fn(torch.ones(2)).tolist() == [2.0, 2.0] and traced == []
    with compile_stance(True):
        assert fn(torch.ones(2)).tolist() == [2.0, 2.0] and len(traced) == 1
    with pytest.raises(ValueError, match="enabled"):
        compile_stance(1)


def test_linear_layers_match_nn_linear_at_world_size_1():
    torch.manual_seed(0)
    x = torch.randn(5, 8)
    ref = nn.Linear(8, 6)
    for layer in (ReplicatedLinear(8, 6, bias=True), ColumnParallelLinear(8, 6, bias=True),
                  RowParallelLinear(8, 6, bias=True)):
        _load(layer, "weight", ref.weight.detach())
        _load(layer, "bias", ref.bias.detach())
        torch.testing.assert_close(layer(x), ref(x))
    gate, up = torch.randn(4, 8), torch.randn(4, 8)
    merged = MergedColumnParallelLinear(8, [4, 4])
    _load(merged, "weight", up, 1)
    _load(merged, "weight", gate, 0)
    torch.testing.assert_close(SiluAndMul()(merged(x)), F.silu(x @ gate.T) * (x @ up.T))
    q, k, v = torch.randn(8, 8), torch.randn(4, 8), torch.randn(4, 8)  # 4 q heads, 2 kv heads of size 2
    qkv = QKVParallelLinear(8, 2, 4, 2)
    for sid, w in zip("qkv", (q, k, v)):
        _load(qkv, "weight", w, sid)
    torch.testing.assert_close(qkv(x), x @ torch.cat([q, k, v]).T)


def test_bad_sizes_raise_value_error(monkeypatch):
    with pytest.raises(ValueError, match="total_num_heads=3"):
        divide(3, 2, "total_num_heads")
    monkeypatch.setattr(linear_mod, "tp_size", lambda: 2)  # pretend to be one of two ranks
    with pytest.raises(ValueError, match="total_num_heads=3 is not divisible"):
        QKVParallelLinear(16, 4, 3, 2)
    with pytest.raises(ValueError, match="total_num_kv_heads=1 is not divisible"):
        QKVParallelLinear(16, 4, 4, 1)
    with pytest.raises(ValueError, match="input_size=7"):
        RowParallelLinear(7, 4)
    with pytest.raises(ValueError, match=r"output_sizes\[1\]=5"):
        MergedColumnParallelLinear(4, [4, 5])
    with pytest.raises(ValueError, match="shard_id"):
        _load(QKVParallelLinear(8, 2, 4), "weight", torch.zeros(8, 8), "x")


def test_embedding_and_lm_head_at_world_size_1():
    torch.manual_seed(0)
    table, hidden = torch.randn(10, 4), torch.randn(6, 4)
    emb, head = VocabParallelEmbedding(10, 4), ParallelLMHead(10, 4)
    _load(emb, "weight", table)
    head.weight = emb.weight  # tied
    ids = torch.tensor([9, 0, 3])
    torch.testing.assert_close(emb(ids), table[ids])
    reset_context()
    torch.testing.assert_close(head(hidden), hidden @ table.T)
    set_context(is_prefill=True, cu_seqlens_q=torch.tensor([0, 1, 4, 6], dtype=torch.int32), max_seqlen_q=3)
    try:
        torch.testing.assert_close(head(hidden), hidden[[0, 3, 5]] @ table.T)
    finally:
        reset_context()
    with pytest.raises(ValueError, match="bias"):
        ParallelLMHead(10, 4, bias=True)


def test_rmsnorm_matches_naive_and_transformers():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    torch.manual_seed(0)
    x, res, w = torch.randn(4, 32) * 2, torch.randn(4, 32), torch.rand(32) + 0.5
    norm, hf = RMSNorm(32), Qwen3RMSNorm(32)
    norm.weight.data.copy_(w)
    hf.weight.data.copy_(w)
    naive = lambda t: t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(norm(x), naive(x))
    torch.testing.assert_close(norm(x), hf(x))
    x0, r0 = x.clone(), res.clone()
    y, new_res = norm(x, res)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(y, hf(x + res))
    assert torch.equal(x, x0) and torch.equal(res, r0)
    norm_b, hf_b = norm.bfloat16(), hf.bfloat16()
    assert norm_b(x.bfloat16()).dtype == torch.bfloat16
    torch.testing.assert_close(norm_b(x.bfloat16()), hf_b(x.bfloat16()))


def test_rope_matches_transformers_at_random_positions():
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    d, theta, max_pos = 32, 1_000_000.0, 40960
    rope = get_rope(d, d, max_pos, theta)
    torch.manual_seed(0)
    pos = torch.randint(0, max_pos, (7,))
    q, k = torch.randn(7, 4, d), torch.randn(7, 2, d)
    q_rot, k_rot = rope(pos, q.flatten(1), k)
    cfg = Qwen3Config(hidden_size=4 * d, head_dim=d, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_pos, rope_parameters={"rope_type": "default", "rope_theta": theta})
    cos, sin = Qwen3RotaryEmbedding(cfg)(q, pos[None])
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert q_rot.shape == (7, 4 * d)
    torch.testing.assert_close(q_rot.view(7, 4, d), q_hf[0].transpose(0, 1), **TOL)
    torch.testing.assert_close(k_rot, k_hf[0].transpose(0, 1), **TOL)
    with pytest.raises(ValueError, match="rope_type"):
        get_rope(d, d, max_pos, theta, {"rope_type": "linear", "factor": 2.0})


def test_silu_and_mul():
    x = torch.randn(3, 10)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :5]) * x[:, 5:])


def test_world_size_2_matches_world_size_1():
    V, D, I, hd, nq, nkv = 16, 8, 12, 2, 4, 2
    torch.manual_seed(0)
    E, W_gate, W_up = torch.randn(V, D), torch.randn(I, D), torch.randn(I, D)
    W_down, b_down = torch.randn(D, I), torch.randn(D)
    ids = torch.tensor([3, 15, 7, 8, 0, 12])
    context = dict(is_prefill=True, cu_seqlens_q=torch.tensor([0, 4, 6], dtype=torch.int32), max_seqlen_q=4)
    toy_lm = ([partial(VocabParallelEmbedding, V, D), partial(MergedColumnParallelLinear, D, [I, I]), SiluAndMul,
               partial(RowParallelLinear, I, D, bias=True), partial(ParallelLMHead, V, D)],
              {"0.weight": E, "1.weight": [(W_gate, 0), (W_up, 1)], "3.weight": W_down, "3.bias": b_down,
               "4.weight": E}, ids, context)
    Wq, Wk, Wv = torch.randn(nq * hd, D), torch.randn(nkv * hd, D), torch.randn(nkv * hd, D)
    bq, bk, bv = torch.randn(nq * hd), torch.randn(nkv * hd), torch.randn(nkv * hd)
    x = torch.randn(3, D)
    attn_proj = ([partial(QKVParallelLinear, D, hd, nq, nkv, bias=True)],
                 {"0.weight": [(Wq, "q"), (Wk, "k"), (Wv, "v")], "0.bias": [(bq, "q"), (bk, "k"), (bv, "v")]}, x)

    ranks = run_tp_workers(_run_jobs, 2, [toy_lm, attn_proj], timeout=60)
    single = _run_jobs([toy_lm, attn_proj])

    emb = E[ids]
    mlp = (F.silu(emb @ W_gate.T) * (emb @ W_up.T)) @ W_down.T + b_down
    for lm, _ in (single, *ranks):
        torch.testing.assert_close(lm[0], emb, **TOL)
        torch.testing.assert_close(lm[3], mlp, **TOL)  # down's bias added exactly once
    torch.testing.assert_close(single[0][4], mlp[[3, 5]] @ E.T, **TOL)
    torch.testing.assert_close(ranks[0][0][4], mlp[[3, 5]] @ E.T, **TOL)
    assert ranks[1][0][4] is None
    q, k, v = x @ Wq.T + bq, x @ Wk.T + bk, x @ Wv.T + bv
    torch.testing.assert_close(single[1][0], torch.cat([q, k, v], dim=-1), **TOL)
    for r, (_, proj) in enumerate(ranks):  # rank r: its query heads, then its key heads, then its value heads
        qs, kvs = slice(r * nq * hd // 2, (r + 1) * nq * hd // 2), slice(r * nkv * hd // 2, (r + 1) * nkv * hd // 2)
        torch.testing.assert_close(proj[0], torch.cat([q[:, qs], k[:, kvs], v[:, kvs]], dim=-1), **TOL)


def test_world_size_2_bad_head_count_fails_fast():
    with pytest.raises(RuntimeError, match="total_num_heads=3 is not divisible by the tensor-parallel size 2"):
        run_tp_workers(shard_and_run, 2, [partial(QKVParallelLinear, 8, 2, 3, 3)], {}, torch.randn(2, 8),
                       timeout=60)


def test_run_tp_workers_times_out_instead_of_hanging():
    import time

    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 2"):
        run_tp_workers(time.sleep, 2, 60, timeout=2)
    assert time.monotonic() - start < 10
