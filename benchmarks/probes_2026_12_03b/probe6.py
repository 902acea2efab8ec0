"""Where a prefill step's host time goes: torch.profiler (CPU side: runtime calls, aten ops) and cProfile
around the runner's launches of a prefill-only run, in one fresh process."""
import cProfile, io, json, os, pstats, sys, time
import torch
from torch.profiler import profile, ProfilerActivity
from nanoengine import LLM, SamplingParams
from nanoengine.bench import ensure_checkpoint, bench_workload, measure_throughput

preset = os.environ.get("PRESET", "qwen3-0.6b")
n = int(os.environ.get("NSEQ", "256"))
llm = LLM(ensure_checkpoint(preset), max_model_len=4096)
mr = llm.model_runner
if preset != "tiny":
    r = measure_throughput(llm)
    print("bench", round(r["output_tok_per_s"]), round(r["prefill_seconds"], 3), r["prefill_step_ms"])
sp = SamplingParams(max_tokens=1, ignore_eos=True)
launch = []
orig = mr._step
def step(seqs, is_prefill, previous, source_rows):
    t = time.perf_counter(); out = orig(seqs, is_prefill, previous, source_rows)
    launch.append((is_prefill, sum(s.num_scheduled_tokens for s in seqs), time.perf_counter() - t)); return out
mr._step = step
llm.generate(bench_workload(n, seed=11)[0], sp, use_tqdm=False)  # warm, other prompts
launch.clear()
prompts = bench_workload(n, seed=12)[0]
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
with profile(activities=acts) as prof:
    t = time.perf_counter(); llm.generate(prompts, sp, use_tqdm=False)
    if torch.cuda.is_available(): torch.cuda.synchronize()
    wall = time.perf_counter() - t
print("prefill-only under torch.profiler: wall", round(wall, 3), "launches (tokens, ms):",
      [(k, round(s * 1e3, 1)) for p, k, s in launch if p])
rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]
for e in rows:
    print(f"  {e.key[:60]:60s} n={e.count:6d} self_cpu={e.self_cpu_time_total/1e3:9.2f} ms")
launch.clear()
pr = cProfile.Profile()
prompts = bench_workload(n, seed=13)[0]
pr.enable(); t = time.perf_counter(); llm.generate(prompts, sp, use_tqdm=False)
if torch.cuda.is_available(): torch.cuda.synchronize()
pr.disable(); wall = time.perf_counter() - t
print("prefill-only under cProfile: wall", round(wall, 3), "launch ms", [round(s * 1e3, 1) for p, k, s in launch if p])
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30); print(s.getvalue()[-6000:])
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(40); print(s.getvalue()[-7000:])
# batch 1: torch.profiler (CPU side) and cProfile over a 300-token single-request decode
launch.clear()
one = SamplingParams(max_tokens=300, ignore_eos=True)
llm.generate([list(range(1, 101))], one, use_tqdm=False)
launch.clear()
with profile(activities=acts) as prof:
    llm.generate([list(range(2, 102))], one, use_tqdm=False)
d = sorted(s for p, k, s in launch if not p)
print("batch-1 launch ms median", round(1e3 * d[len(d) // 2], 3), "p90", round(1e3 * d[int(.9 * len(d))], 3), "n", len(d))
rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]
for e in rows:
    print(f"  {e.key[:60]:60s} n={e.count:6d} self_cpu={e.self_cpu_time_total/1e3:9.2f} ms")
pr = cProfile.Profile(); pr.enable(); llm.generate([list(range(3, 103))], one, use_tqdm=False); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30); print(s.getvalue()[-6000:])
llm.close()
