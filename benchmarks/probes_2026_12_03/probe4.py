"""One fresh process: host time per step (launch, wait) vs the step's wall time, prefill and batch 1."""
import json, os, sys, time
from statistics import median as _median
def median(x): return _median(x) if x else 0
import torch
from nanoengine import LLM
from nanoengine.bench import ensure_checkpoint, measure_throughput, measure_latency

def cpu_now():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[36])

def py_speed():
    t = time.perf_counter(); s = 0
    for i in range(2_000_000): s += i & 7
    return round((time.perf_counter() - t) * 1e3, 1)

out = {"i": sys.argv[1], "affinity": len(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
       "py_ms_before": py_speed(), "cpus": [cpu_now()]}
llm = LLM(ensure_checkpoint("qwen3-0.6b"), max_model_len=4096)
mr = llm.model_runner
log = []
orig_step, orig_wait = mr._step, mr._wait
def step(seqs, is_prefill, previous, source_rows):
    t = time.perf_counter(); r = orig_step(seqs, is_prefill, previous, source_rows)
    log.append(("launch", is_prefill, len(seqs), time.perf_counter() - t)); return r
def wait(ready):
    t = time.perf_counter(); orig_wait(ready); log.append(("wait", None, 0, time.perf_counter() - t))
mr._step, mr._wait = step, wait
log.clear()
r = measure_throughput(llm)
out["cpus"].append(cpu_now())
out.update(tok_s=round(r["output_tok_per_s"]), prefill=round(r["prefill_seconds"], 4), decode=round(r["decode_seconds"], 4),
           steps=r["prefill_step_ms"])
# the timed run's launches: skip the warm-up request's (first few entries)
L = [x for x in log if x[0] == "launch"]
pre = [round(x[3] * 1e3, 2) for x in L if x[1] and x[2] > 1]
dec = [x[3] * 1e3 for x in L if not x[1] and x[2] > 1]
W = [x[3] * 1e3 for x in log if x[0] == "wait"]
out.update(prefill_launch_ms=pre[:12], decode_launch_ms_median=round(median(dec), 3),
           wait_ms_total=round(sum(W), 1), wait_ms_first20=[round(w, 2) for w in W[:20]])
log.clear()
lat = measure_latency(llm)
L = [x[3] * 1e3 for x in log if x[0] == "launch" and not x[1] and x[2] == 1]
W = [x[3] * 1e3 for x in log if x[0] == "wait"]
out.update(lat=round(lat["ms_per_token"], 3), b1_launch_ms_median=round(median(L), 4), b1_launch_ms_p90=round(sorted(L)[int(.9 * len(L))], 4) if L else 0,
           b1_wait_ms_median=round(median(W), 4), b1_n=len(L), py_ms_after=py_speed())
out["cpus"].append(cpu_now())
llm.close()
print("RESULT", json.dumps(out), flush=True)
