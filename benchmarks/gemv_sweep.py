"""Time cuBLAS (F.linear) against nanoengine's Triton gemv for Qwen3-0.6B's four projections at 1, 2 and 4 rows.

    python benchmarks/gemv_sweep.py OUT.json        (needs a CUDA GPU; writes benchmarks/h200_gemv.json's format)

Each timing replays a CUDA graph that calls the kernel on ten different copies of the weight in turn, so that no
weight is served from the L2 cache (as in a real forward pass, where 28 layers' weights pass through), each call
after a small kernel that writes its input (as a projection follows a norm in the model)."""
import json
import sys

import torch
import torch.nn.functional as F

from nanoengine.bench import provenance
from nanoengine.kernels.gemv import GEMV_BLOCK_N, _graph_time_us, gemv
from nanoengine.kernels.paged_decode import pdl_capable

SHAPES = {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048), "gate_up_proj": (6144, 1024), "down_proj": (1024, 3072)}


def main(out: str) -> dict:
    results = {}
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(10)]
        for m in (1, 2, 4):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            error = (gemv(x, weights[0]).float() - F.linear(x, weights[0]).float()).abs().max().item()
            results[f"{name} m={m}"] = {"cublas_us": round(_graph_time_us(lambda x, w: F.linear(x, w), weights, x, 20), 3),
                                        "gemv_us": round(_graph_time_us(gemv, weights, x, 20), 3),
                                        "max_abs_diff": error}
            print(name, m, results[f"{name} m={m}"], flush=True)
    data = {"provenance": provenance(), "dtype": "bfloat16", "shapes": SHAPES,
            "gemv_config": {"BLOCK_N": GEMV_BLOCK_N, "BLOCK_K": "K rounded up to a power of two",
                            "num_warps": "8 from K = 2048, else 4",
                            "programmatic_dependent_launch": pdl_capable(torch.device("cuda"))},
            "results": results}
    with open(out, "w") as f:
        json.dump(data, f, indent=2)
    return data


if __name__ == "__main__":
    main(sys.argv[1])
