"""Where the bench workload's prompt steps spend their time: the GPU busy, idle, and what the host was doing.

    python benchmarks/prefill_profile.py OUT.json      (needs a CUDA GPU; engine switches through the environment)

One fresh engine (max_model_len 4096, as `python -m nanoengine.bench`) and the warm-up request; then the bench
workload's first `--steps` engine steps (its prompt steps and the first decode step) run un-profiled once, timed
step by step, and again in a second engine call under torch.profiler. For each profiled step: its wall span, the
GPU's kernel time (the union of kernel intervals), its idle time and its longest idle gaps, and the host
operations that were running when each long gap began. The workload is run only this far both times (the
remaining requests are aborted), so the engine repeats the same prompt steps from an empty cache with prefix
caching off."""
import argparse
import json
import os
from collections import Counter
from time import perf_counter

os.environ.setdefault("NANOENGINE_PREFIX_CACHING", "0")  # the second pass must not hit the first one's blocks

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from nanoengine import LLM, SamplingParams
from nanoengine.bench import bench_workload, ensure_checkpoint, provenance


def run_steps(llm, prompts, params, steps: int, mark: bool = False) -> list[dict]:
    """Queue the workload, take `steps` engine steps (each inside a profiler range when `mark`), then
    abort every request."""
    seqs = llm._make_requests(prompts, params)
    for seq in seqs:
        llm.scheduler.add(seq)
    records = []
    torch.cuda.synchronize()
    for _ in range(steps):
        t0 = perf_counter()
        if mark:
            with torch.profiler.record_function("nanoengine.step"):
                llm.step()
        else:
            llm.step()
        records.append({"wall_ms": round((perf_counter() - t0) * 1000, 3)})
    for rec, tr in zip(records, list(llm.trace)[-steps:]):
        rec.update(tokens=tr.num_tokens, seqs=tr.num_seqs, prefill=tr.is_prefill,
                   planned_ahead=tr.planned_ahead, step_ms=round(tr.seconds * 1000, 3))
    llm._release(seqs)
    torch.cuda.synchronize()
    return records


def gpu_timeline(prof) -> tuple[list, list]:
    """Kernel intervals (start, end, name) in microseconds, and host op intervals (start, end, name)."""
    events = prof.events()
    kernels = sorted((e.time_range.start, e.time_range.end, e.key) for e in events
                     if e.device_type == DeviceType.CUDA)
    host = sorted((e.time_range.start, e.time_range.end, e.key) for e in events
                  if e.device_type != DeviceType.CUDA)
    return kernels, host


def summarize(kernels, host, marks) -> list[dict]:
    """Per step window [marks[i], marks[i + 1]): kernel time, idle gaps, the host ops open at long gaps."""
    out = []
    for a, b in zip(marks, marks[1:]):
        ks = [k for k in kernels if a <= k[0] < b]
        busy, gaps, last = 0.0, [], None
        for s, e, name in ks:
            if last is not None and s > last[0]:
                gaps.append((s - last[0], last[0], last[1], name))
            if last is None or e > last[0]:
                busy += e - max(s, last[0]) if last is not None and s < last[0] else e - s
                last = (e, name)
        gaps.sort(reverse=True)
        long = []
        for g, at, before, after in gaps[:8]:
            open_ops = [h[2] for h in host if h[0] <= at + g / 2 <= h[1]][-4:]
            long.append({"gap_us": round(g, 1), "after": before[:60], "before": after[:60],
                         "host_ops_mid_gap": open_ops})
        top = Counter()
        for s, e, name in ks:
            top[name[:60]] += e - s
        out.append({
            "window_ms": round((b - a) / 1000, 3), "kernels": len(ks), "kernel_busy_ms": round(busy / 1000, 3),
            "idle_ms": round(sum(g[0] for g in gaps) / 1000, 3),
            "gaps_over_20us": sum(1 for g in gaps if g[0] > 20),
            "idle_in_gaps_over_20us_ms": round(sum(g[0] for g in gaps if g[0] > 20) / 1000, 3),
            "longest_gaps": long, "top_kernels_ms": [[n, round(t / 1000, 3)] for n, t in top.most_common(8)],
        })
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=11)
    args = ap.parse_args()
    llm = LLM(ensure_checkpoint("qwen3-0.6b"), max_model_len=4096)
    prompts, params = bench_workload(256, 1024, 1024)
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
    plain = run_steps(llm, prompts, params, args.steps)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        profiled = run_steps(llm, prompts, params, args.steps, mark=True)
    kernels, host = gpu_timeline(prof)
    starts = sorted(h[0] for h in host if h[2] == "nanoengine.step")
    result = {"provenance": provenance(), "steps_unprofiled": plain, "steps_profiled": profiled,
              "num_kernels": len(kernels), "host_ops": len(host),
              "note": "window i runs from the start of the i-th LLMEngine.step call to the next one's; with "
                      "async scheduling a call completes one step and launches the next"}
    result["windows"] = summarize(kernels, host, starts + [kernels[-1][1] + 1])
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "windows"}, indent=1))
    for w in result["windows"]:
        print(json.dumps({k: v for k, v in w.items() if k != "longest_gaps"}))
        for g in w["longest_gaps"][:4]:
            print("   ", g)


if __name__ == "__main__":
    main()
