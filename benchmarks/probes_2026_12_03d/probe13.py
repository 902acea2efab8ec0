"""Where the host's time goes in the bench workload's prompt steps: cProfile over the first 9 steps of a pass."""
import cProfile, io, json, pstats, sys, time
sys.path.insert(0, "benchmarks")
import torch
from prefill_profile import HostTimers, run_steps, shifted
from nanoengine import LLM, SamplingParams
from nanoengine.bench import bench_workload, ensure_checkpoint

llm = LLM(ensure_checkpoint("qwen3-0.6b"), max_model_len=4096)
prompts, params = bench_workload(256, 1024, 1024)
llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
print("plain", [r["step_ms"] for r in run_steps(llm, prompts, params, 10)])
t = HostTimers(llm)
recs = run_steps(llm, shifted(prompts, 1), params, 10, timers=t)
t.remove()
for r in recs:
    print(r["step_ms"], r["host_ms"])
pr = cProfile.Profile()
pr.enable()
recs = run_steps(llm, shifted(prompts, 2), params, 9)
pr.disable()
print("profiled", [r["step_ms"] for r in recs])
for key in ("tottime", "cumulative"):
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats(key).print_stats(45)
    txt = s.getvalue()
    print("\n".join(l[:170] for l in txt.splitlines()[:60]))
