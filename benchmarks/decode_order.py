"""Time section 08.1's decode kernel on the bench workload's own mixes of context lengths, with the sequences started
in the batch's order and longest first, against the same number of keys spread evenly.

    python benchmarks/decode_order.py OUT.json      (needs a CUDA GPU)

Decode step s of the bench workload (every request prefilled, none finished early) holds the requests whose
max_tokens exceed s, each with its prompt plus s + 1 tokens of context. Each case is that step's attention in all 28
layers of Qwen3-0.6B (16 query heads over 8 KV heads of 128, bf16, blocks of 256 scattered at random, every layer
its own pool), replayed from a CUDA graph captured for the engine's block-table width at max_model_len 4096; the
time is per layer. The results are written after every case."""
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paged_decode_sweep import BLOCK, HEAD_DIM, HEADS, KV_HEADS, graph_us, scattered_step  # noqa: E402

from nanoengine.bench import bench_workload, provenance  # noqa: E402
from nanoengine.kernels.paged_decode import decode_partition, paged_decode  # noqa: E402

STEPS = (0, 150, 300, 450, 550, 650, 750, 850, 950)
WIDTH = math.ceil(4096 / BLOCK)  # the graphs' block-table width


def step_lengths(step: int) -> list[int]:
    """Context lengths of the requests still decoding at decode step `step`, in the batch's order."""
    prompts, params = bench_workload()
    return [len(p) + step + 1 for p, s in zip(prompts, params) if s.max_tokens > step]


def time_case(lens: list[int], orders: bool = True) -> dict:
    """Microseconds per layer with the rows in the batch's order and (if `orders`) longest first."""
    pools, tables, ctx = scattered_step(lens, WIDTH)
    q = torch.randn(len(lens), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    scale = HEAD_DIM**-0.5
    row = {"batch_order_us": graph_us(lambda i: paged_decode(q, *pools[i], tables, ctx, scale))}
    if orders:
        longest_first = ctx.argsort(descending=True)
        row["same_bits"] = torch.equal(paged_decode(q, *pools[0], tables, ctx, scale),
                                       paged_decode(q, *pools[0], tables, ctx, scale, longest_first))
        row["longest_first_us"] = graph_us(lambda i: paged_decode(q, *pools[i], tables, ctx, scale, longest_first))
    del pools
    torch.cuda.empty_cache()
    return row


def measure_step(step: int) -> dict:
    """One decode step's mix in both orders, and as many keys spread evenly over its sequences."""
    lens = step_lengths(step)
    row = {"batch": len(lens), "mean_keys": sum(lens) / len(lens), "max_keys": max(lens),
           "partition": decode_partition(len(lens), KV_HEADS, WIDTH * BLOCK), **time_case(lens)}
    row["even_us"] = time_case([sum(lens) // len(lens)] * len(lens), orders=False)["batch_order_us"]
    kv_bytes = sum(lens) * KV_HEADS * HEAD_DIM * 2 * 2
    for key in ("batch_order", "longest_first", "even"):
        row[f"{key}_tb_per_s"] = round(kv_bytes / row[f"{key}_us"] / 1e6, 3)
    return row


def main(path: str) -> dict:
    results = {"provenance": provenance(), "what": __doc__.split("\n\n")[0], "cases": {}}
    for step in STEPS:
        row = results["cases"][f"decode step {step}"] = measure_step(step)
        print(step, row, flush=True)
        Path(path).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main(sys.argv[1])
