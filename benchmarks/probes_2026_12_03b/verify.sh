# GPU tests, chapters 09 and 11 with every cell, and bench processes with the launch fields
export PYTHONUNBUFFERED=1; source .carry/setup.sh >/dev/null
python3 scripts/gpu_check.py --part tests --gpu-tests only --workers 8 --gpu-tests-timeout 240 --tests-timeout 260 --tests-log $OUT/gputests.log --out $OUT/part_gputests.json 2>&1 | tail -4
python3 scripts/gpu_check.py --part notebooks --notebooks 09_model_runner 11_cuda_graphs --jobs 2 --deadline 200 --out $OUT/part_nb2.json 2>&1 | tail -3
for i in 1 2 3; do
  python3 -m nanoengine.bench --throughput --latency --out $OUT/v_$i.json > /dev/null 2>&1 || { echo "bench $i failed"; continue; }
  python3 - $OUT/v_$i.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); t = d["throughput"]; l = d["latency"]
print(round(t["output_tok_per_s"]), "prefill", round(t["prefill_seconds"], 3), "decode", round(t.get("decode_seconds", 0), 3), "launch", t["prefill_launch_ms"],
      "dec_launch", round(t["decode_launch_ms_median"], 3), "b1", round(l["ms_per_token"], 3), round(l["launch_ms_median"], 3), flush=True)
PY
done
