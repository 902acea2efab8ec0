"""Is the first pass of the bench workload's prompt steps after warm-up slower than later ones? Fresh engine,
bench warm-up, then five 12-step passes (prompts shifted so nothing is cached), step ms from the engine trace."""
import json, sys, subprocess, threading, time
sys.path.insert(0, "benchmarks")
import torch
from prefill_profile import run_steps, shifted
from nanoengine import LLM, SamplingParams
from nanoengine.bench import bench_workload, ensure_checkpoint, provenance

clocks = []
def poll(stop):
    while not stop.is_set():
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5).stdout.strip()
            clocks.append((round(time.perf_counter(), 3), out))
        except Exception as e:
            clocks.append((0, repr(e)))
        time.sleep(0.05)

llm = LLM(ensure_checkpoint("qwen3-0.6b"), max_model_len=4096)
prompts, params = bench_workload(256, 1024, 1024)
llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
stop = threading.Event(); th = threading.Thread(target=poll, args=(stop,), daemon=True); th.start()
out = {"provenance": provenance(), "passes": []}
marks = []
for shift in range(5):
    time.sleep(1.0 if shift == 3 else 0.0)
    t0 = time.perf_counter()
    recs = run_steps(llm, shifted(prompts, shift) if shift else prompts, params, 12)
    marks.append((round(t0, 3), round(time.perf_counter(), 3)))
    ms = [r["step_ms"] for r in recs]
    out["passes"].append({"shift": shift, "slept_before_s": 1.0 if shift == 3 else 0.0, "step_ms": ms,
                          "prompt_steps_ms": round(sum(ms[:9]), 1)})
    print(shift, round(sum(ms[:9]), 1), ms, flush=True)
stop.set(); th.join()
out["pass_windows"] = marks
out["smi"] = clocks
json.dump(out, open(sys.argv[1], "w"), indent=1)
for a, b in marks:
    sel = [c[1] for c in clocks if a <= c[0] <= b]
    print("pass", sel[:2], "...", sel[-2:], len(sel))
