#!/usr/bin/env bash
# Reproduce benchmarks/h200.json on a machine with a CUDA GPU: GPU tests, then every benchmark, with logs.
#   bash benchmarks/reproduce.sh OUT_DIR
# flash-attn must be importable (pip install flash-attn, or scripts/build_flash_attn.sh; see book/flash_attn.md).
set -uo pipefail
OUT=${1:?usage: bash benchmarks/reproduce.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch, flash_attn; print(torch.cuda.get_device_name(0), 'flash-attn', flash_attn.__version__)"
timeout 300 python3 -m pytest -o addopts="" -p no:cacheprovider -q -m gpu tests/ > "$OUT/gpu_tests.log" 2>&1
tail -n 15 "$OUT/gpu_tests.log"
timeout 400 python3 -m nanoengine.bench --throughput --latency --decode-sweep --profile --out "$OUT/main.json" \
    > "$OUT/bench.log" 2>&1
tail -n 6 "$OUT/bench.log"
timeout 400 python3 -m nanoengine.bench --ablations --out "$OUT/ablations.json" > "$OUT/ablations.log" 2>&1
tail -n 6 "$OUT/ablations.log"
