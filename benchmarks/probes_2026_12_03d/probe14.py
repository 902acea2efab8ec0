"""Same-process A/B of the unfused prologues' Triton kernels (NANOENGINE_PROLOGUE_KERNELS read per call): host
milliseconds per prompt step (HostTimers) and step ms, passes alternating, prompts shifted so nothing is cached."""
import json, os, sys
sys.path.insert(0, "benchmarks")
from statistics import median
from prefill_profile import HostTimers, run_steps, shifted
from nanoengine import LLM, SamplingParams
from nanoengine.bench import bench_workload, ensure_checkpoint, provenance

llm = LLM(ensure_checkpoint("qwen3-0.6b"), max_model_len=4096)
prompts, params = bench_workload(256, 1024, 1024)
llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
os.environ["NANOENGINE_PROLOGUE_KERNELS"] = "0"
run_steps(llm, shifted(prompts, 99), params, 3)  # the compiled functions' first calls
out = {"provenance": provenance(), "passes": []}
for i, pk in enumerate("1010101"):
    os.environ["NANOENGINE_PROLOGUE_KERNELS"] = pk
    t = HostTimers(llm)
    recs = run_steps(llm, shifted(prompts, i + 1), params, 10, timers=t)
    t.remove()
    fwd = [r["host_ms"].get("forward", 0) for r in recs[1:8]]
    row = {"pk": pk, "step_ms": [r["step_ms"] for r in recs], "forward_host_ms": [round(f, 2) for f in fwd],
           "prepare_prefill_ms": [r["host_ms"].get("prepare_prefill", 0) for r in recs[1:8]],
           "median_forward_ms": round(median(fwd), 2), "prompt_steps_ms": round(sum(r["step_ms"] for r in recs[:9]), 1)}
    out["passes"].append(row)
    print(pk, row["median_forward_ms"], row["prompt_steps_ms"], row["step_ms"][:9], flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
