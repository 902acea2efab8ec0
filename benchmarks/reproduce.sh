#!/usr/bin/env bash
# Reproduce the committed H200 data on a machine with a CUDA GPU: GPU tests, then every benchmark, with logs.
#   bash benchmarks/reproduce.sh OUT_DIR
# Writes OUT_DIR/main.json (benchmarks/h200.json without the ablations), before_gemv.json (h200_before_gemv.json),
# fusions_neither.json and fusions_prologues.json (with main.json: h200_fusions.json), gemv.json (h200_gemv.json),
# paged_decode.json (h200_paged_decode.json), without_triton_decode.json (h200.json's latency_without_triton_decode),
# decode_tune.json (h200_decode_tune.json), decode_order.json (h200_decode_order.json), race.json (h200_race.json),
# step_trace.json (h200_step_trace.json) and ablations.json (h200.json's ablations);
# each step has its own log. About 19 minutes on an H200 before the last two steps were added and the ladder
# measured batch-1 latency too; not timed end to end since (decode_order.py took 37 s).
# flash-attn must be importable (pip install flash-attn, or scripts/build_flash_attn.sh; see book/flash_attn.md).
set -uo pipefail
OUT=${1:?usage: bash benchmarks/reproduce.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch, flash_attn; print(torch.cuda.get_device_name(0), 'flash-attn', flash_attn.__version__)"
timeout 300 python3 -m pytest -o addopts="" -p no:cacheprovider -q -m gpu tests/ > "$OUT/gpu_tests.log" 2>&1
tail -n 3 "$OUT/gpu_tests.log"
timeout 600 python3 -m nanoengine.bench --throughput --latency --decode-sweep --profile --out "$OUT/main.json" \
    > "$OUT/bench.log" 2>&1
tail -n 6 "$OUT/bench.log"
# cuBLAS for every projection and FlashAttention-2's decode: the engine before sections 08.1, 11.1, 11.2 and 11.3
timeout 300 python3 -m nanoengine.bench --latency --profile --out "$OUT/before_gemv.json" --engine-json \
    '{"optimizations": {"triton_gemv": false, "fused_prologues": false, "fused_rope_store": false, "triton_decode": false}}' \
    > "$OUT/before_gemv.log" 2>&1
tail -n 3 "$OUT/before_gemv.log"
# h200_fusions.json's runs: neither of sections 11.2 and 11.3, then 11.2 alone (main.json has both)
timeout 300 python3 -m nanoengine.bench --latency --profile --out "$OUT/fusions_neither.json" \
    --engine-json '{"optimizations": {"fused_prologues": false, "fused_rope_store": false}}' \
    > "$OUT/fusions_neither.log" 2>&1
timeout 300 python3 -m nanoengine.bench --latency --profile --out "$OUT/fusions_prologues.json" \
    --engine-json '{"optimizations": {"fused_rope_store": false}}' > "$OUT/fusions_prologues.log" 2>&1
tail -n 3 "$OUT/fusions_neither.log" "$OUT/fusions_prologues.log"
timeout 300 python3 benchmarks/gemv_sweep.py "$OUT/gemv.json" > "$OUT/gemv.log" 2>&1
tail -n 12 "$OUT/gemv.log"
timeout 300 python3 benchmarks/paged_decode_sweep.py "$OUT/paged_decode.json" > "$OUT/paged_decode.log" 2>&1
tail -n 8 "$OUT/paged_decode.log"
timeout 300 python3 -m nanoengine.bench --latency --out "$OUT/without_triton_decode.json" \
    --engine-json '{"optimizations": {"triton_decode": false}}' > "$OUT/without_triton_decode.log" 2>&1
tail -n 1 "$OUT/without_triton_decode.log"
timeout 300 python3 benchmarks/decode_tune.py "$OUT/decode_tune.json" > "$OUT/decode_tune.log" 2>&1
tail -n 3 "$OUT/decode_tune.log"
timeout 300 python3 benchmarks/decode_order.py "$OUT/decode_order.json" > "$OUT/decode_order.log" 2>&1
tail -n 9 "$OUT/decode_order.log" | cut -c1-160
timeout 300 python3 benchmarks/race_sampler.py "$OUT/race.json" > "$OUT/race.log" 2>&1
tail -n 8 "$OUT/race.log"
timeout 300 python3 benchmarks/step_trace.py "$OUT/step_trace.json" > "$OUT/step_trace.log" 2>&1
tail -n 1 "$OUT/step_trace.log" | cut -c1-160
# The ladder: every rung of nanoengine.bench.ABLATIONS but those of ONLY_WHEN_NAMED ("torch attention", not a speed
# rung), each an engine configuration built in its own fresh process (--rung NAME on its command line), with
# throughput and batch-1 latency; ablations.json grows after every rung. --only RUNG (repeatable) runs fewer.
timeout 1800 python3 -m nanoengine.bench --ablations --out "$OUT/ablations.json" > "$OUT/ablations.log" 2>&1
tail -n 10 "$OUT/ablations.log"
