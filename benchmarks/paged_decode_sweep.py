"""Time nanoengine's Triton paged decode kernel against flash-attn's flash_attn_with_kvcache.

    python benchmarks/paged_decode_sweep.py OUT.json      (needs a CUDA GPU and flash-attn)

Qwen3-0.6B's attention shape (16 query heads over 8 KV heads of 128, bf16, block size 256). Each case is one decode
step's attention in all 28 layers, every layer with its own pool and the blocks scattered at random, replayed from
a CUDA graph; the time is per layer. flash-attn runs the way the engine called it before the kernel existed (one
split up to 1,024 keys, else its own heuristic)."""
import json
import math
import sys

import torch

from nanoengine.bench import provenance
from nanoengine.kernels.paged_decode import decode_partition, paged_decode

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 16, 8, 128, 256, 28
CASES = {
    "256 x 512 keys": [512] * 256,
    "128 x 200-2000 keys": None,  # drawn below
    "64 x 1500 keys": [1500] * 64,
    "32 x 800 keys": [800] * 32,
    "8 x 1000 keys": [1000] * 8,
    "1 x 100 keys": [100],
    "1 x 600 keys": [600],
    "1 x 3000 keys": [3000],
}


def scattered_step(lens: list[int], width: int, device: str = "cuda") -> tuple[list, torch.Tensor, torch.Tensor]:
    """One decode step's caches for every layer (bf16, LAYERS pools, blocks handed out in a random order), its block
    tables (`width` blocks, -1 padded) and its context lengths (int32), seeded with 0."""
    torch.manual_seed(0)
    blocks = [math.ceil(n / BLOCK) for n in lens]
    pools = [tuple(torch.randn(sum(blocks) + 1, BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
                   for _ in range(2)) for _ in range(LAYERS)]
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    order, at = torch.randperm(sum(blocks)) + 1, 0
    for i, b in enumerate(blocks):
        tables[i, :b] = order[at:at + b]
        at += b
    return pools, tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def graph_us(fn, repeats: int = 20) -> float:
    """Microseconds per layer of fn(layer) over LAYERS layers, replayed from a CUDA graph."""
    for i in range(LAYERS):
        fn(i)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAYERS):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / repeats / LAYERS


def main(out: str) -> dict:
    from flash_attn import flash_attn_with_kvcache

    results = {}
    for name, lens in CASES.items():
        if lens is None:
            lens = torch.randint(200, 2001, (128,), generator=torch.Generator().manual_seed(1)).tolist()
        torch.manual_seed(0)
        blocks = [math.ceil(n / BLOCK) for n in lens]
        width = max(blocks) if max(lens) > 1024 else math.ceil(4096 / BLOCK)  # the graph's width
        pools = [(torch.randn(sum(blocks) + 1, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
                  torch.randn(sum(blocks) + 1, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16))
                 for _ in range(LAYERS)]
        order = (torch.randperm(sum(blocks)) + 1).tolist()
        tables = torch.zeros(len(lens), max(width, max(blocks)), dtype=torch.int32)
        for s, n in enumerate(blocks):
            tables[s, :n] = torch.tensor(order[:n], dtype=torch.int32)
            order = order[n:]
        tables, context_lens = tables.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")
        q = torch.randn(len(lens), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        scale = HEAD_DIM**-0.5
        splits = 1 if max(lens) <= 1024 else 0

        def flash(i):
            return flash_attn_with_kvcache(q.unsqueeze(1), *pools[i], cache_seqlens=context_lens, block_table=tables,
                                           softmax_scale=scale, causal=True, num_splits=splits).squeeze(1)

        def ours(i):
            return paged_decode(q, *pools[i], tables, context_lens, scale)

        error = (ours(0).float() - flash(0).float()).abs().max().item()
        kv_bytes = sum(lens) * KV_HEADS * HEAD_DIM * 2 * 2
        flash_us, triton_us = graph_us(flash), graph_us(ours)
        results[name] = {
            "kv_bytes_per_layer": kv_bytes, "flash_us": round(flash_us, 2), "triton_us": round(triton_us, 2),
            "flash_tb_per_s": round(kv_bytes / flash_us / 1e6, 3), "triton_tb_per_s": round(kv_bytes / triton_us / 1e6, 3),
            "partition": decode_partition(len(lens), KV_HEADS, tables.shape[1] * BLOCK), "max_abs_diff": error,
        }
        print(name, results[name], flush=True)
        del pools
        torch.cuda.empty_cache()
    data = {"provenance": provenance(), "dtype": "bfloat16", "heads": HEADS, "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM, "block_size": BLOCK, "layers": LAYERS, "results": results}
    with open(out, "w") as f:
        json.dump(data, f, indent=2)
    return data


if __name__ == "__main__":
    main(sys.argv[1])
