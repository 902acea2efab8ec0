#!/usr/bin/env bash
# Build a small FlashAttention-2 from its source distribution when no prebuilt wheel matches your torch/CUDA pair.
# It keeps only what nanoengine calls: forward kernels (varlen prefill, paged KV, split-KV decode) for exactly the
# head dimensions you list (Qwen3 uses 128), fp16 and bf16, for one GPU architecture. That is a few dozen CUDA files instead of hundreds,
# and minutes instead of hours.
#
#   bash scripts/build_flash_attn.sh flash_attn-2.8.3.post2.tar.gz /path/to/site   [ARCH=90] [HEAD_DIMS="128"]
#   export PYTHONPATH=/path/to/site:$PYTHONPATH && python -c "import flash_attn"
#
# Get the source distribution with: FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE pip download --no-deps \
#   --no-build-isolation flash-attn==2.8.3.post2 -d .   (needs torch, psutil, ninja, packaging and einops installed)
set -euo pipefail
SDIST=$(realpath "$1")
TARGET=$(realpath -m "$2")
ARCH=${ARCH:-90}
HEAD_DIMS=${HEAD_DIMS:-128}
BUILD=$(mktemp -d)
trap 'rm -rf "$BUILD"' EXIT
tar -xzf "$SDIST" -C "$BUILD"
cd "$BUILD"/flash_attn-*/
HEAD_DIMS="$HEAD_DIMS" python3 - <<'PY'
import os
import re
from pathlib import Path

dims = sorted(int(d) for d in os.environ["HEAD_DIMS"].split())
setup = Path("setup.py")
text = setup.read_text()
# Keep the API file and the forward kernels for our head dims; drop every backward and other-dim kernel.
wanted = {f"flash_fwd{split}_hdim{d}_{dtype}{causal}_sm80.cu" for d in dims for split in ("", "_split")
          for dtype in ("fp16", "bf16") for causal in ("", "_causal")}
def keep(match):
    name = match.group(1).rsplit("/", 1)[-1]
    return match.group(0) if name == "flash_api.cpp" or name in wanted else ""
text = re.sub(r'\s*"(csrc/flash_attn/[^"]+\.(?:cu|cpp))",', keep, text)
for feature in ("BACKWARD", "DROPOUT", "ALIBI", "SOFTCAP", "UNEVEN_K", "LOCAL"):
    text = text.replace(f'# "-DFLASHATTENTION_DISABLE_{feature}",', f'"-DFLASHATTENTION_DISABLE_{feature}",')
setup.write_text(text)
# Dispatch each compiled head dim to its kernel; any other head dim is a clear error (uneven head dims are compiled out).
switch = Path("csrc/flash_attn/src/static_switch.h")
header = switch.read_text()
start = header.index("#define HEADDIM_SWITCH")
cases = " else ".join(f"if (HEADDIM == {d}) {{ constexpr static int kHeadDim = {d}; return __VA_ARGS__(); }}"
                      for d in dims)
header = (header[:start] + f"#define HEADDIM_SWITCH(HEADDIM, ...) [&] {{ {cases} else {{ "
          f'TORCH_CHECK(false, "this flash-attn build has head dims {dims} only"); }} }}()\n')
switch.write_text("#include <c10/util/Exception.h>\n" + header)
# The backward entry point refers to kernels we no longer compile: make it an error instead.
api = Path("csrc/flash_attn/flash_api.cpp")
source = api.read_text()
head = "void run_mha_bwd(Flash_bwd_params &params, cudaStream_t stream) {"
i = source.index(head)
j = source.index("\n}\n", i)
api.write_text(source[:i] + head + '\n    TORCH_CHECK(false, "this flash-attn build has no backward pass");'
               + source[j:])
PY
FLASH_ATTN_CUDA_ARCHS="$ARCH" FLASH_ATTENTION_FORCE_BUILD=TRUE MAX_JOBS=${MAX_JOBS:-$(nproc)} NVCC_THREADS=2 \
    python3 -m pip install -q --no-build-isolation --no-deps --no-cache-dir --target "$TARGET" .
ls "$TARGET"/flash_attn_2_cuda*.so
