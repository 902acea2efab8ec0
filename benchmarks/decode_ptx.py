"""What the compiler makes of section 08.1's decode kernel for a Hopper GPU (sm_90), with a bfloat16 cache and with
a float8 one: the shared-memory, asynchronous-copy and tensor-core instructions in its PTX. Compiling needs no GPU
(Triton's own LLVM and ptxas), so this runs on any machine; the counts depend on the Triton version, which the JSON
records. Section 13.1 reads them to explain why the float8 kernel reads half the bytes at half the rate.

    python benchmarks/decode_ptx.py benchmarks/host_decode_ptx.json

The launch is the engine's for an unsplit batch-256 step of Qwen3-0.6B (2 query heads per KV head, head dim 128,
256-token blocks, 64 keys per tile, 4 warps, 3 stages), with the divisibility by 16 that Triton's launcher finds in
the real pointers and strides."""
import collections
import json
import re
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nanoengine.bench import provenance
from nanoengine.kernels.paged_decode import DECODE_BLOCK_N, _decode_kernel

# PTX instructions by what they do (a regular expression each, counted over the whole kernel)
KINDS = {
    "ldmatrix": r"ldmatrix\.sync\.aligned\.m8n8\.x\d\.shared",  # a warp loads a tensor-core tile from shared memory
    "ldmatrix_trans": r"ldmatrix\.sync\.aligned\.m8n8\.x\d\.trans\.shared",  # ... transposed (16-bit elements only)
    "shared_byte_loads": r"ld\.shared(?:\.v[24])?\.b8\b",  # one byte (or two, four) at a time
    "shared_word_loads": r"ld\.shared(?:\.v[24])?\.b32\b",
    "shared_stores": r"st\.shared(?:\.v[24])?\.b\d+\b",
    "async_copies_16_bytes": r"cp\.async\.cg\.shared\.global",  # global -> shared, 16 bytes, the pipeline's loads
    "async_copies_small": r"cp\.async\.ca\.shared\.global",  # 4 or 8 bytes
    "float8_conversions": r"cvt\.rn\.f16x2\.e4m3x2",  # two float8 values to two float16 in one instruction
    "tensor_core_mma": r"mma\.sync\.aligned",
}


def compile_decode(fp8: bool) -> dict:
    """The decode kernel compiled for sm_90: its instruction counts and shared memory bytes."""
    kv = "*fp8e4nv" if fp8 else "*bf16"
    signature = {
        "q_ptr": "*bf16", "k_ptr": kv, "v_ptr": kv, "ks_ptr": "*fp32" if fp8 else kv,
        "vs_ptr": "*fp32" if fp8 else kv, "tables_ptr": "*i32", "lens_ptr": "*i32", "order_ptr": "*i32",
        "o_ptr": "*bf16", "part_ptr": "*fp32", "stats_ptr": "*fp32", "scale": "fp32", "stride_qb": "i32",
        "stride_qh": "i32", "stride_block": "i32", "stride_key": "i32", "stride_tb": "i32", "stride_ob": "i32",
        "stride_oh": "i32",
    }
    constants = dict(PARTITION=512, BLOCK_SIZE=256, GROUP=2, GROUP_PAD=16, D=128, BLOCK_N=DECODE_BLOCK_N,
                     SPLIT=False, ORDERED=True, PDL=False, INTERPRET=False, FP8=fp8)
    signature |= {name: "constexpr" for name in constants}
    names = list(signature)
    aligned = [n for n in names if n.endswith("_ptr") or n.startswith("stride")]
    source = ASTSource(_decode_kernel, signature,
                       constexprs={(names.index(k),): v for k, v in constants.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    ptx = kernel.asm["ptx"]
    counts = {kind: len(re.findall(pattern, ptx)) for kind, pattern in KINDS.items()}
    other = collections.Counter(re.findall(r"\b(ld\.shared[.a-z0-9]*)", ptx))
    return {"counts": counts, "shared_loads": dict(sorted(other.items())), "shared_memory_bytes": kernel.metadata.shared}


def main(path: str) -> dict:
    results = {"provenance": provenance(), "what": __doc__.split("\n\n")[0],
               "launch": "unsplit, 2 query heads per KV head, head dim 128, 256-token blocks, "
                         f"{DECODE_BLOCK_N} keys per tile, 4 warps, 3 stages, sm_90",
               "kernels": {"auto": compile_decode(False), "fp8": compile_decode(True)}}
    Path(path).write_text(json.dumps(results, indent=1) + "\n")
    for name, r in results["kernels"].items():
        print(name, r["counts"], f"{r['shared_memory_bytes']:,} bytes of shared memory")
    return results


if __name__ == "__main__":
    main(sys.argv[1])
