# topology, a profiled prefill-only run (probe6) and bench processes, each watched by mon.py; all into $OUT
lscpu > $OUT/lscpu.txt; for c in /sys/devices/system/cpu/cpu[0-9]*; do echo "$(basename $c) $(cat $c/topology/thread_siblings_list) $(cat $c/topology/core_id)"; done > $OUT/siblings.txt
grep -i -E "nvidia|CPU" /proc/interrupts | head -3 > $OUT/irq_before.txt; cp /proc/interrupts $OUT/interrupts_before.txt
python3 .carry/probe6.py > $OUT/probe6.txt 2>&1 & p=$!; python3 .carry/mon.py $p $OUT/mon_probe6.txt & wait $p
grep -E "^bench|launches|launch ms" $OUT/probe6.txt
for i in 1 2 3; do
  pre=""; [ $i = 2 ] && pre="env OMP_NUM_THREADS=1"
  $pre python3 -m nanoengine.bench --throughput --latency --out $OUT/p8_$i.json > $OUT/p8_$i.log 2>&1 & p=$!
  python3 .carry/mon.py $p $OUT/mon_$i.txt & wait $p
  python3 - $OUT/p8_$i.json "$i $pre" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); t = d["throughput"]; l = d["latency"]
print(sys.argv[2], round(t["output_tok_per_s"]), "prefill", round(t["prefill_seconds"], 3), "launch", t["prefill_launch_ms"],
      "dec_launch", round(t["decode_launch_ms_median"], 2), "b1", round(l["ms_per_token"], 3), round(l["launch_ms_median"], 3), flush=True)
PY
done
cp /proc/interrupts $OUT/interrupts_after.txt
