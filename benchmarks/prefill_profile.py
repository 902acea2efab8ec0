"""Where the bench workload's prompt steps spend their time: the GPU busy, idle, and what the host was doing.

    python benchmarks/prefill_profile.py OUT.json      (needs a CUDA GPU)

One fresh engine (max_model_len 4096, as `python -m nanoengine.bench`) and the warm-up request; then the bench
workload's first `--steps` engine steps (its prompt steps and the first decode steps) three times: un-profiled,
timed step by step; with the host's parts of each step timed (scheduling ahead, input packing, the forward
pass's launches, sampling, the wait for the tokens); and under torch.profiler. The later passes shift the
prompts' tokens, so that they find none of their blocks in the prefix cache, and each pass runs only this far
(the remaining requests are aborted). For each profiled step: its wall span, the GPU's kernel time (the union of
kernel intervals), its idle time and longest idle gaps with the host operations open at each, and the host
operations with the most self time."""
import argparse
import json
from collections import Counter
from time import perf_counter

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from nanoengine import LLM, SamplingParams
from nanoengine.bench import bench_workload, ensure_checkpoint, provenance


class HostTimers:
    """Milliseconds spent in the host's parts of a step, summed per LLMEngine.step call."""

    def __init__(self, llm):
        r, sched = llm.model_runner, llm.scheduler
        self.totals: Counter = Counter()
        self.undo = []
        for owner, name in ((sched, "schedule_ahead"), (sched, "postprocess"), (r, "prepare_prefill"),
                            (r, "prepare_decode"), (r, "prepare_sample"), (r.model, "forward"),
                            (r.model, "compute_logits"), (r, "_sample"), (r, "_wait")):
            self._wrap(owner, name)

    def _wrap(self, owner, name) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[name] += (perf_counter() - t0) * 1000

        setattr(owner, name, timed)
        self.undo.append((owner, name))

    def take(self) -> dict:
        out = {k: round(v, 3) for k, v in self.totals.items()}
        self.totals.clear()
        return out

    def remove(self) -> None:
        for owner, name in self.undo:
            delattr(owner, name)


def run_steps(llm, prompts, params, steps: int, mark: bool = False, timers=None) -> list[dict]:
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
        if timers is not None:
            records[-1]["host_ms"] = timers.take()
    for rec, tr in zip(records, list(llm.trace)[-steps:]):
        rec.update(tokens=tr.num_tokens, seqs=tr.num_seqs, prefill=tr.is_prefill,
                   planned_ahead=tr.planned_ahead, step_ms=round(tr.seconds * 1000, 3))
    llm._release(seqs)
    torch.cuda.synchronize()
    return records


def shifted(prompts: list[list[int]], by: int = 1) -> list[list[int]]:
    """The same prompt lengths with other tokens: a later pass finds none of its blocks cached."""
    return [[(t + by) % 150_000 + 1 for t in p] for p in prompts]


def gpu_timeline(prof) -> tuple[list, list]:
    """Kernel intervals (start, end, name) in microseconds, and host op intervals (start, end, name)."""
    events = prof.events()
    kernels = sorted((e.time_range.start, e.time_range.end, e.key) for e in events
                     if e.device_type == DeviceType.CUDA and e.key != "nanoengine.step")  # not its GPU range
    host = sorted((e.time_range.start, e.time_range.end, e.key, e.self_cpu_time_total) for e in events
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
        for g, at, before, after in gaps[:6]:
            open_ops = [h[2] for h in host if h[0] <= at + g / 2 <= h[1]][-4:]
            long.append({"gap_us": round(g, 1), "after": before[:60], "before": after[:60],
                         "host_ops_mid_gap": open_ops})
        top = Counter()
        for s, e, name in ks:
            top[name[:60]] += e - s
        host_self = Counter()
        for h in host:
            if a <= h[0] < b:
                host_self[h[2][:60]] += h[3]
        out.append({
            "window_ms": round((b - a) / 1000, 3), "kernels": len(ks), "kernel_busy_ms": round(busy / 1000, 3),
            "idle_ms": round(sum(g[0] for g in gaps) / 1000, 3),
            "gaps_over_20us": sum(1 for g in gaps if g[0] > 20),
            "idle_in_gaps_over_20us_ms": round(sum(g[0] for g in gaps if g[0] > 20) / 1000, 3),
            "longest_gaps": long, "top_kernels_ms": [[n, round(t / 1000, 3)] for n, t in top.most_common(8)],
            "top_host_self_ms": [[n, round(t / 1000, 3)] for n, t in host_self.most_common(12)],
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
    timers = HostTimers(llm)
    timed = run_steps(llm, shifted(prompts), params, args.steps, timers=timers)
    timers.remove()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        profiled = run_steps(llm, shifted(prompts, 2), params, args.steps, mark=True)
    kernels, host = gpu_timeline(prof)
    starts = sorted(h[0] for h in host if h[2] == "nanoengine.step")
    result = {"provenance": provenance(), "steps_unprofiled": plain, "steps_host_timed": timed,
              "steps_profiled": profiled,
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
