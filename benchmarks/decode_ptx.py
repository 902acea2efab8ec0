"""What the compiler makes of section 08.1's decode kernel for a Hopper GPU (sm_90), with a bfloat16 cache and with
a float8 one: the shared-memory, asynchronous-copy and tensor-core instructions in its PTX, and the registers and
shared memory each program holds, hence how many programs one SM can run at once. Compiling needs no GPU (Triton's
own LLVM, ptxas and cuobjdump), so this runs on any machine; the counts depend on the Triton version, which the JSON
records. Section 13.1 reads them to explain why the float8 kernel was slow with the bfloat16 kernel's launch
settings, and what its own settings change.

    python benchmarks/decode_ptx.py benchmarks/host_decode_ptx.json

The launch is the engine's for an unsplit batch-256 step of Qwen3-0.6B (2 query heads per KV head, head dim 128,
256-token blocks, 4 warps), with the divisibility by 16 that Triton's launcher finds in the real pointers and
strides; each kernel at the tile and pipeline depth `paged_decode` gives it, and the float8 one also at the
bfloat16 kernel's."""
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nanoengine.bench import provenance
from nanoengine.kernels.paged_decode import _decode_kernel, decode_launch

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


# One Hopper SM (H100 and H200 alike): what its resident programs share
SM90 = {"registers": 65_536, "shared_memory_bytes": 228 * 1024, "max_warps": 64, "max_programs": 32}
WARPS = 4
# (float8, keys per tile, pipeline stages, V transposed): paged_decode's own for an unsplit step over the engine's
# pools, and the float8 kernel as section 13.1 follows it: at the bfloat16 kernel's settings over V stored row by
# row (the first version), at 32 keys a tile over V row by row (its own settings then), at 32 keys over V transposed
LAUNCHES = {"auto": (False, *decode_launch(False, False), False), "fp8": (True, *decode_launch(True, False), True),
            "fp8_v_transposed_32_keys": (True, 32, 2, True), "fp8_v_row_by_row": (True, 32, 2, False),
            "fp8_at_bfloat16_setting": (True, *decode_launch(False, False), False)}


def resources(cubin: bytes) -> dict[str, int]:
    """Registers per thread and static shared memory of a compiled kernel, from cuobjdump."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    return {"registers_per_thread": int(re.search(r"REG:(\d+)", usage).group(1)),
            "static_shared_bytes": int(re.search(r"SHARED:(\d+)", usage).group(1))}


def programs_per_sm(registers: int, shared_bytes: int, warps: int = WARPS) -> dict[str, int]:
    """How many programs of `warps` warps one SM holds at once, and what binds: registers are
    given out per warp in units of 256, shared memory per program."""
    per_warp = -(-registers * 32 // 256) * 256
    limits = {"by_registers": SM90["registers"] // (per_warp * warps),
              "by_shared_memory": SM90["shared_memory_bytes"] // shared_bytes,
              "by_warps": SM90["max_warps"] // warps, "by_programs": SM90["max_programs"]}
    return {"programs": min(limits.values()), **limits}


def compile_decode(fp8: bool, block_n: int, stages: int, v_transposed: bool) -> dict:
    """The decode kernel compiled for sm_90: its instruction counts, registers and shared memory."""
    kv = "*fp8e4nv" if fp8 else "*bf16"
    signature = {
        "q_ptr": "*bf16", "k_ptr": kv, "v_ptr": kv, "ks_ptr": "*fp32" if fp8 else kv,
        "vs_ptr": "*fp32" if fp8 else kv, "tables_ptr": "*i32", "lens_ptr": "*i32", "order_ptr": "*i32",
        "o_ptr": "*bf16", "part_ptr": "*fp32", "stats_ptr": "*fp32", "scale": "fp32", "stride_qb": "i32",
        "stride_qh": "i32", "stride_block": "i32", "stride_key": "i32", "stride_vb": "i32", "stride_vk": "i32",
        "stride_vh": "i32", "stride_vd": "i32", "stride_tb": "i32", "stride_ob": "i32", "stride_oh": "i32",
    }
    # V's stride 1 (Triton passes an integer 1 as a constant): along the keys when V lies transposed
    # within each block (fp8_value_layout, the engine's float8 pool), along the dims row by row
    constants = dict(PARTITION=512, BLOCK_SIZE=256, GROUP=2, GROUP_PAD=16, D=128, BLOCK_N=block_n,
                     SPLIT=False, ORDERED=True, PDL=False, INTERPRET=False, FP8=fp8,
                     V_RUN=256,  # V's keys side by side across a whole block of 256
                     **({"stride_vk": 1} if v_transposed else {"stride_vd": 1}))
    signature |= {name: "constexpr" for name in constants}
    names = list(signature)
    aligned = [n for n in names if (n.endswith("_ptr") or n.startswith("stride")) and n not in constants]
    source = ASTSource(_decode_kernel, signature,
                       constexprs={(names.index(k),): v for k, v in constants.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": WARPS, "num_stages": stages})
    ptx = kernel.asm["ptx"]
    counts = {kind: len(re.findall(pattern, ptx)) for kind, pattern in KINDS.items()}
    other = collections.Counter(re.findall(r"\b(ld\.shared[.a-z0-9]*)", ptx))
    used = resources(kernel.asm["cubin"])
    shared = kernel.metadata.shared + used["static_shared_bytes"]
    return {"keys_per_tile": block_n, "stages": stages, "v_transposed": v_transposed, "counts": counts,
            "shared_loads": dict(sorted(other.items())), "shared_memory_bytes": kernel.metadata.shared,
            **used, "per_sm": programs_per_sm(used["registers_per_thread"], shared)}


def main(path: str) -> dict:
    results = {"provenance": provenance(), "what": __doc__.split("\n\n")[0],
               "launch": f"unsplit, 2 query heads per KV head, head dim 128, 256-token blocks, {WARPS} warps, "
                         "sm_90; keys per tile and stages per kernel", "sm90": SM90,
               "kernels": {name: compile_decode(*launch) for name, launch in LAUNCHES.items()}}
    Path(path).write_text(json.dumps(results, indent=1) + "\n")
    for name, r in results["kernels"].items():
        print(name, r["counts"], f"{r['shared_memory_bytes']:,} bytes of shared memory,",
              f"{r['registers_per_thread']} registers a thread, {r['per_sm']['programs']} programs an SM")
    return results


if __name__ == "__main__":
    main(sys.argv[1])
