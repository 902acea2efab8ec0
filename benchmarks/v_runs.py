"""The float8 V cache in runs of R slots (chapter 07a's `fp8_value_layout`): per layer, the fused RoPE + store of one
decode step, the decode kernel over the step's keys, the two back to back, and the store of one prompt step, for R
from a whole block of 256 slots down to 16.

    python benchmarks/v_runs.py OUT.json          (needs a CUDA GPU)

The decode step is 256 sequences of 512 keys, Qwen3-0.6B's shapes (16 query and 8 KV heads of 128), their blocks
scattered over a pool of the engine's size on the H200; the prompt step stores 16,384 tokens in consecutive slots.
Every run length reads and writes the same memory, reinterpreted. Times are microseconds per layer, replayed from a
CUDA graph over 8 layers, each pool its own memory, as a step's layers are."""
import json
import sys
from pathlib import Path

import torch

from nanoengine.bench import provenance
from nanoengine.kernels.kv_fp8 import FP8_V_RUN, fp8_value_layout
from nanoengine.kernels.paged_decode import paged_decode
from nanoengine.kernels.rope_store import qk_norm_rope_store

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 16, 8, 128, 256, 8
SEQS, KEYS, PROMPT_TOKENS, POOL_BLOCKS = 256, 512, 16_384, 8_592
RUNS = (256, 128, 64, 32, 16)


def graph_us(fn, repeats: int = 20) -> float:
    """Microseconds per layer of fn() (all LAYERS layers), replayed from a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / repeats / LAYERS


def step_inputs(tokens: int, positions: torch.Tensor) -> dict:
    """A fused QKV output of `tokens` rows and what the RoPE + store kernel takes with it."""
    return dict(
        qkv=torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=torch.bfloat16),
        positions=positions, q_weight=torch.ones(HEAD_DIM, device="cuda", dtype=torch.bfloat16),
        k_weight=torch.ones(HEAD_DIM, device="cuda", dtype=torch.bfloat16), eps=1e-6,
        cos_sin_cache=torch.randn(4096, 1, HEAD_DIM, device="cuda"),
    )


def main(path: str) -> dict:
    torch.manual_seed(0)
    shape = (POOL_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    pools = []
    for _ in range(LAYERS):  # finite e4m3 bytes, and scales near those of real keys and values
        k, v = (torch.empty(shape, device="cuda", dtype=torch.uint8).random_(0, 120).view(torch.float8_e4m3fn)
                for _ in range(2))
        scales = tuple(torch.rand(shape[:3], device="cuda") * 0.01 + 1e-3 for _ in range(2))
        pools.append((k, v, scales))
    per_seq = KEYS // BLOCK
    tables = (torch.randperm(POOL_BLOCKS - 1)[: SEQS * per_seq] + 1).view(SEQS, per_seq).int().cuda()
    lens = torch.full((SEQS,), KEYS, dtype=torch.int32, device="cuda")
    order = torch.arange(SEQS, device="cuda")
    slots = tables[:, -1].long() * BLOCK + (KEYS - 1) % BLOCK  # each sequence's newest key
    decode_in = step_inputs(SEQS, torch.full((SEQS,), KEYS - 1, device="cuda"))
    prompt_slots = torch.arange(BLOCK, BLOCK + PROMPT_TOKENS, device="cuda")  # blocks 1 to 64
    prompt_in = step_inputs(PROMPT_TOKENS, torch.arange(PROMPT_TOKENS, device="cuda") % 4096)
    q = torch.randn(SEQS, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    results = {"provenance": provenance(), "what": __doc__.split("\n\n")[0], "engine_run": FP8_V_RUN,
               "seqs": SEQS, "keys": KEYS, "prompt_tokens": PROMPT_TOKENS, "pool_blocks": POOL_BLOCKS,
               "layers": LAYERS, "runs": []}
    for run in RUNS:
        caches = [(k, fp8_value_layout(v, run), s) for k, v, s in pools]

        def store(inputs: dict, where: torch.Tensor) -> None:
            for k, v, s in caches:
                qk_norm_rope_store(**inputs, k_cache=k, v_cache=v, slot_mapping=where, num_heads=HEADS,
                                   num_kv_heads=KV_HEADS, kv_scales=s)

        def decode() -> None:
            for k, v, s in caches:
                paged_decode(q, k, v, tables, lens, HEAD_DIM**-0.5, order, s)

        def both() -> None:
            store(decode_in, slots)
            decode()

        row = {"run": run, "decode_store_us": graph_us(lambda: store(decode_in, slots)),
               "decode_us": graph_us(decode), "store_and_decode_us": graph_us(both),
               "prompt_store_us": graph_us(lambda: store(prompt_in, prompt_slots))}
        print(json.dumps({key: round(x, 1) if isinstance(x, float) else x for key, x in row.items()}), flush=True)
        results["runs"].append(row)
        Path(path).write_text(json.dumps(results, indent=1) + "\n")  # what a cut-short run measured
    results["gpu"] = torch.cuda.get_device_name()
    Path(path).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main(sys.argv[1])
