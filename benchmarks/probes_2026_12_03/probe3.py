"""One fresh process: standalone GEMM speed, the bench's prefill, a profiled prefill-only run, power-cap counters."""
import json, os, re, subprocess, sys, time
import torch
from nanoengine import LLM, SamplingParams
from nanoengine.bench import ensure_checkpoint, measure_throughput, bench_workload

def capped():
    q = subprocess.run(["nvidia-smi", "-q", "-d", "PERFORMANCE"], capture_output=True, text=True).stdout
    m = re.search(r"SW Power Capping\s*:\s*(\d+) us", q); h = re.search(r"HW Slowdown\s*:\s*(\d+) us", q)
    return int(m.group(1)) if m else -1

def mm_ms(reps=30):
    a = torch.randn(16384, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(6144, 1024, device="cuda", dtype=torch.bfloat16)
    for _ in range(3): a @ w.t()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(reps): a @ w.t()
    e.record(); torch.cuda.synchronize()
    return round(s.elapsed_time(e) / reps, 4)

out = {"i": sys.argv[1]}
t = time.perf_counter()
llm = LLM(ensure_checkpoint("qwen3-0.6b"), max_model_len=4096)
out["startup_s"] = round(time.perf_counter() - t, 1)
out["mm_before"] = mm_ms()
c0 = capped()
r = measure_throughput(llm)
out["cap_us_throughput"] = capped() - c0
out.update(tok_s=round(r["output_tok_per_s"]), prefill=round(r["prefill_seconds"], 4),
           decode=round(r["decode_seconds"], 4), steps=r["prefill_step_ms"])
out["mm_after"] = mm_ms()
from nanoengine.bench import measure_latency
out["lat"] = [round(measure_latency(llm)["ms_per_token"], 3) for _ in range(2)]
out["gemv"] = sorted(k for k, v in llm.model_runner.gemv_report.items() if v.get("gemv"))
out["fused"] = sorted(k for k, v in llm.model_runner.fused_report.items() if v.get("fused"))
prompts, _ = bench_workload(seed=1)
sp = SamplingParams(max_tokens=1, ignore_eos=True)
llm.generate(prompts[:8], sp, use_tqdm=False)  # not the same prompts as below: no prefix hits
prompts2, _ = bench_workload(seed=2)
from torch.profiler import profile, ProfilerActivity
c0 = capped()
torch.cuda.synchronize(); t = time.perf_counter()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    llm.generate(prompts2, sp, use_tqdm=False); torch.cuda.synchronize()
out["prof_wall_s"] = round(time.perf_counter() - t, 4)
out["cap_us_prof"] = capped() - c0
agg = {}
for ev in prof.key_averages():
    if ev.device_type.name != "CUDA" and getattr(ev, "self_device_time_total", 0) == 0: continue
    us = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
    if us: agg[ev.key[:90]] = (round(us / 1e3, 2), ev.count)
top = sorted(agg.items(), key=lambda kv: -kv[1][0])[:14]
out["prof_total_ms"] = round(sum(v[0] for v in agg.values()), 1)
out["prof_top"] = top
llm.close()
print("RESULT", json.dumps(out), flush=True)
