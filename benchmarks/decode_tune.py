"""Time section 08.1's decode kernel under other launch settings than the engine's (keys per tile, warps, pipeline
stages, and for split steps the keys per partition), on four of paged_decode_sweep.py's cases: 256 sequences of 512
keys (unsplit, most of a batch-256 step), and one sequence of 100 or 600 keys and eight of 1,000 (split, with the
combine kernel).

    python benchmarks/decode_tune.py OUT.json          (needs a CUDA GPU)
    python benchmarks/decode_tune.py OUT.json --fp8    (the same over float8 caches with their scales, 13.1)
    python benchmarks/decode_tune.py OUT.json --fp8 --v-rows   (... with V stored row by row, not transposed)
    python benchmarks/decode_tune.py OUT.json --fp8 --only "256 x 512 keys"   (one case)

Each setting is checked against the engine's own (`paged_decode`) before it is timed, and the results are written
after every setting, so a run cut short keeps what it measured. The engine's setting is timed first."""
import json
import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paged_decode_sweep import BLOCK, HEAD_DIM, HEADS, KV_HEADS, graph_us, scattered_step  # noqa: E402

from nanoengine.bench import provenance  # noqa: E402
from nanoengine.kernels.kv_fp8 import fp8_value_layout, quantize_kv  # noqa: E402
from nanoengine.kernels.paged_decode import (  # noqa: E402
    _combine_kernel, _decode_kernel, decode_launch, decode_partition, paged_decode, pdl_capable,
)

CASES = {"256 x 512 keys": [512] * 256, "1 x 600 keys": [600], "1 x 100 keys": [100], "8 x 1000 keys": [1000] * 8}


def settings(fp8: bool, split: bool) -> list:
    """(keys per partition, per tile, warps, stages), paged_decode's own first (None: the engine's partition)."""
    block_n, stages = decode_launch(fp8, split)
    own = (None, block_n, 4, stages)
    if split:
        return [own] + [(p, n, w, s) for p in (64, 128, 256) for n in (32, 64) for w in (4, 8) for s in (2, 3)]
    return [own] + [(None, n, w, s) for n in (64, 128, 32) for w in (4, 8) for s in (2, 3, 1)
                    if (None, n, w, s) != own]


def launch(q, kc, vc, ks, vs, tables, lens, out, part, stats, partition, num_parts, block_n, warps, stages,
           order=None):
    """paged_decode's launch with the tile, warps and stages given (and, unsplit, the sequences' order); float8
    caches read their scales `ks`, `vs`, other caches pass themselves there (unread)."""
    pdl, ordered = pdl_capable(q.device), order is not None and num_parts == 1
    _decode_kernel[(KV_HEADS, q.shape[0], num_parts)](
        q, kc, vc, ks, vs, tables, lens, order if ordered else lens, out, part, stats, HEAD_DIM**-0.5, q.stride(0),
        q.stride(1), kc.stride(0), kc.stride(1), *vc.stride(), tables.stride(0), out.stride(0), out.stride(1),
        PARTITION=partition,
        BLOCK_SIZE=BLOCK, GROUP=HEADS // KV_HEADS, GROUP_PAD=16, D=HEAD_DIM, BLOCK_N=block_n, SPLIT=num_parts > 1,
        ORDERED=ordered, PDL=pdl,
        INTERPRET=False, FP8=kc.dtype == torch.float8_e4m3fn, V_RUN=vc.shape[1], launch_pdl=pdl, num_warps=warps,
        num_stages=stages,
    )
    if num_parts > 1:
        _combine_kernel[(q.shape[0], HEADS)](
            part, stats, lens, out, out.stride(0), out.stride(1), NUM_PARTS=num_parts,
            PARTS_PAD=triton.next_power_of_2(num_parts), PARTITION=partition, D=HEAD_DIM, PDL=pdl, launch_pdl=pdl,
        )


def float8_pools(pools: list, v_transposed: bool = True) -> list:
    """Each layer's (K, V) caches quantized as the engine stores them, V transposed in the engine's runs
    (`fp8_value_layout`; row by row with v_transposed=False): (K, V, K scales, V scales)."""
    layout = fp8_value_layout if v_transposed else (lambda v: v)
    return [(kq, layout(vq), ks, vs) for (kq, ks), (vq, vs) in ((quantize_kv(k), quantize_kv(v)) for k, v in pools)]


def main(path: str, fp8: bool = False, v_rows: bool = False, only: str | None = None) -> dict:
    results = {"provenance": provenance(), "what": __doc__.split("\n\n")[0], "fp8": fp8, "cases": {}}
    if fp8:
        results["v_layout"] = "row by row" if v_rows else "transposed in runs of FP8_V_RUN slots (the engine's)"
    for name, lens in CASES.items():
        if only is not None and name != only:
            continue
        width = math.ceil(4096 / BLOCK)  # the graph's width at max_model_len 4096
        pools, tables, ctx = scattered_step(lens, width)
        pools = float8_pools(pools, not v_rows) if fp8 else [(k, v, k, v) for k, v in pools]
        q = torch.randn(len(lens), HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        engine_partition = decode_partition(len(lens), KV_HEADS, width * BLOCK)
        split = engine_partition < width * BLOCK
        out = torch.empty_like(q)
        kv_scales = pools[0][2:] if fp8 else None
        want = paged_decode(q, *pools[0][:2], tables, ctx, HEAD_DIM**-0.5, kv_scales=kv_scales)
        case = results["cases"][name] = {"engine_partition": engine_partition, "settings": []}
        for partition, block_n, warps, stages in settings(fp8, split):
            partition = partition or engine_partition
            num_parts = triton.cdiv(width * BLOCK, partition)
            part = torch.empty(len(lens) * HEADS * num_parts, HEAD_DIM, device="cuda")
            stats = torch.empty(len(lens) * HEADS * num_parts, 2, device="cuda")
            row = {"partition": partition, "block_n": block_n, "num_warps": warps, "num_stages": stages}
            try:
                launch(q, *pools[0], tables, ctx, out, part, stats, partition, num_parts, block_n, warps, stages)
                row["max_abs_diff"] = (out.float() - want.float()).abs().max().item()
                if row["max_abs_diff"] <= 1e-2:
                    row["us_per_layer"] = graph_us(lambda i: launch(
                        q, *pools[i], tables, ctx, out, part, stats, partition, num_parts, block_n, warps, stages))
            except Exception as e:  # a setting the compiler refuses (shared memory, registers)
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            case["settings"].append(row)
            print(name, row, flush=True)
            Path(path).write_text(json.dumps(results, indent=1) + "\n")
        pools.clear()
        torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    args = sys.argv[2:]
    only = args[args.index("--only") + 1] if "--only" in args else None
    if only is not None and only not in CASES:
        raise SystemExit(f"--only takes one of {list(CASES)}, got {only!r}")
    main(sys.argv[1], fp8="--fp8" in args, v_rows="--v-rows" in args, only=only)
