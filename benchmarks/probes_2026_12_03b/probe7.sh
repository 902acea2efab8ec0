# Pinned (taskset to one core) against unpinned fresh bench processes: does the core decide the host's speed?
# usage: bash .carry/probe7.sh N  (PYTHONPATH set by setup.sh); prints tok/s, prefill, launch per prefill step, batch 1
for i in $(seq 1 $1); do
  for mode in pinned free; do
    pre=""; [ $mode = pinned ] && pre="taskset -c $((2 + i))"
    $pre python3 -m nanoengine.bench --throughput --latency --out /tmp/p7_${mode}_$i.json > /dev/null 2>&1 || { echo "$mode $i failed"; continue; }
    python3 - /tmp/p7_${mode}_$i.json $mode <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); t = d["throughput"]; l = d["latency"]
print(sys.argv[2], round(t["output_tok_per_s"]), "prefill", round(t["prefill_seconds"], 3), "launch", t["prefill_launch_ms"],
      "dec_launch", round(t["decode_launch_ms_median"], 2), "b1", round(l["ms_per_token"], 3), round(l["launch_ms_median"], 3), flush=True)
PY
  done
done
