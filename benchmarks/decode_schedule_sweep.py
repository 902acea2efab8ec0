"""The decode kernel over the bench workload's own decode steps, with the engine's partition and with others.

    python benchmarks/decode_schedule_sweep.py OUT.json [EVERY]      (needs a CUDA GPU)

The bench's 1,023 decode steps are rebuilt from its draws (the requests still running at step k are those whose
max_tokens exceed k + 1; each attends its prompt and the k + 1 tokens it has so far), and every EVERY-th one (32
unless given) is timed as one step's attention in all 28 layers, replayed from a CUDA graph, each layer with its own
pool of 791 scattered blocks (the most any step needs). The grid is the decode graphs' (block tables 16 wide, as at
max_model_len 4096), so the partition is what `decode_partition` picks for the batch, as inside a captured graph.
Each step is timed with the engine's choice (`paged_decode`, longest context first when unsplit) and with every
forced partition of PARTITIONS; each forced setting is checked against the engine's output first. The seconds per
setting are summed over the sampled steps and scaled by EVERY: an estimate of the attention's share of the decode
phase, and of what another partition rule would save."""
import json
import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_tune import launch  # noqa: E402
from paged_decode_sweep import BLOCK, HEAD_DIM, HEADS, KV_HEADS, LAYERS, graph_us  # noqa: E402

from nanoengine.bench import bench_workload, provenance  # noqa: E402
from nanoengine.kernels.paged_decode import DECODE_BLOCK_N, decode_partition, paged_decode  # noqa: E402

WIDTH = 4096 // BLOCK  # the decode graphs' block-table width at max_model_len 4096
POOL_BLOCKS = 791  # the most blocks any of the bench's decode steps holds
PARTITIONS = (256, 512, 1024, 2048)


def bench_steps() -> list[list[int]]:
    """Context lengths of each decode step of the bench workload (nanoengine.bench's own draws)."""
    prompts, params = bench_workload()
    outputs = [p.max_tokens for p in params]
    return [[len(p) + k + 1 for p, o in zip(prompts, outputs) if o - 1 > k] for k in range(max(outputs) - 1)]


def main(path: str, every: int = 32) -> dict:
    torch.manual_seed(0)
    pools = [tuple(torch.randn(POOL_BLOCKS + 1, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                   for _ in range(2)) for _ in range(LAYERS)]
    steps = bench_steps()
    results = {"provenance": provenance(), "what": __doc__.split("\n\n")[1], "every": every, "steps": []}
    totals: dict[str, float] = {}
    for k in range(0, len(steps), every):
        lens = steps[k]
        blocks = [math.ceil(n / BLOCK) for n in lens]
        order = (torch.randperm(POOL_BLOCKS) + 1).tolist()
        tables = torch.full((len(lens), WIDTH), -1, dtype=torch.int32)
        at = 0
        for s, n in enumerate(blocks):
            tables[s, :n] = torch.tensor(order[at:at + n], dtype=torch.int32)
            at += n
        tables, ctx = tables.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")
        q = torch.randn(len(lens), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        scale = HEAD_DIM**-0.5
        engine_partition = decode_partition(len(lens), KV_HEADS, WIDTH * BLOCK)
        unsplit = engine_partition >= WIDTH * BLOCK
        desc = torch.argsort(ctx, descending=True) if unsplit else None  # as TritonDecodeMixin.decode
        want = paged_decode(q, *pools[0], tables, ctx, scale, desc)
        kv_bytes = sum(lens) * KV_HEADS * HEAD_DIM * 2 * 2
        row = {"step": k, "batch": len(lens), "keys": sum(lens), "max_keys": max(lens),
               "engine_partition": engine_partition, "us_per_layer": {}}
        row["us_per_layer"]["engine"] = graph_us(lambda i: paged_decode(q, *pools[i], tables, ctx, scale, desc))
        out = torch.empty_like(q)
        for partition in PARTITIONS:
            num_parts = triton.cdiv(WIDTH * BLOCK, partition)
            part = torch.empty(len(lens) * HEADS * num_parts, HEAD_DIM, device="cuda")
            stats = torch.empty(len(lens) * HEADS * num_parts, 2, device="cuda")

            def forced(i, partition=partition, num_parts=num_parts, part=part, stats=stats):
                launch(q, *pools[i], tables, ctx, out, part, stats, partition, num_parts, DECODE_BLOCK_N, 4, 2)

            forced(0)
            diff = (out.float() - want.float()).abs().max().item()
            if diff > 1e-2:
                raise AssertionError(f"step {k}, partition {partition}: differs from paged_decode by {diff}")
            row["us_per_layer"][str(partition)] = graph_us(forced)
        for name, us in row["us_per_layer"].items():
            totals[name] = totals.get(name, 0.0) + us * LAYERS * every / 1e6
        best = min(row["us_per_layer"], key=row["us_per_layer"].get)
        totals["best of each step"] = totals.get("best of each step", 0.0) + (
            row["us_per_layer"][best] * LAYERS * every / 1e6)
        row["engine_tb_per_s"] = round(kv_bytes / row["us_per_layer"]["engine"] / 1e6, 3)
        row["us_per_layer"] = {n: round(u, 2) for n, u in row["us_per_layer"].items()}
        results["steps"].append(row)
        print(row, flush=True)
        results["estimated_decode_attention_seconds"] = {n: round(s, 4) for n, s in totals.items()}
        Path(path).write_text(json.dumps(results, indent=1) + "\n")
    print(results["estimated_decode_attention_seconds"])
    return results


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 32)
