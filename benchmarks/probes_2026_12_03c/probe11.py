"""Non-attention cost of a decode step by batch size: graph replay time vs its kernels, and the whole step."""
import json, sys
from collections import defaultdict
from time import perf_counter
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from nanoengine import LLM, SamplingParams
from nanoengine.bench import ensure_checkpoint, provenance

def cat(name):
    n = name.lower()
    for key, c in (("nvjet", "gemm"), ("gemm", "gemm"), ("cutlass", "gemm"), ("gemv", "gemv"), ("_decode_kernel", "attention"),
                   ("_combine", "attention"), ("rsqrt", "norm"), ("silu", "silu_mul"), ("rope", "rope_store"),
                   ("race", "sampler"), ("memcpy", "copy"), ("copy", "copy"), ("fill", "copy"), ("index", "copy")):
        if key in n:
            return c
    return "other:" + name[:60]

def kernels(prof):
    ev = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    ev.sort(key=lambda e: e.time_range.start)
    total = sum(e.time_range.end - e.time_range.start for e in ev)
    union, cur_s, cur_e = 0.0, None, None
    for e in ev:
        s, t = e.time_range.start, e.time_range.end
        if cur_e is None or s > cur_e:
            if cur_e is not None: union += cur_e - cur_s
            cur_s, cur_e = s, t
        else: cur_e = max(cur_e, t)
    if cur_e is not None: union += cur_e - cur_s
    span = (ev[-1].time_range.end - ev[0].time_range.start) if ev else 0.0
    by = defaultdict(float); count = defaultdict(int)
    for e in ev:
        by[cat(e.name)] += e.time_range.end - e.time_range.start; count[cat(e.name)] += 1
    return total, union, span, by, count, len(ev)

def main(out):
    llm = LLM(ensure_checkpoint("qwen3-0.6b"), max_model_len=4096)
    r = llm.model_runner
    res = {"provenance": provenance(), "rows": []}
    for bs in [1, 8, 32, 64, 128, 256]:
        seqs = [llm.add_request([1 + (i * 7 + j) % 1000 for j in range(16)],
                                SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=400)) for i in range(bs)]
        while any(s.num_completion_tokens == 0 for s in seqs):
            llm.step()
        for _ in range(5): llm.step()
        torch.cuda.synchronize(); t = perf_counter(); n = 60
        for _ in range(n): llm.step()
        torch.cuda.synchronize(); step_ms = 1000 * (perf_counter() - t) / n
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20): llm.step()
            torch.cuda.synchronize()
        st = kernels(prof)
        # the graph alone, replayed back to back
        with torch.inference_mode():
            packed = r.pack_decode(seqs); mx = max(s.num_tokens for s in seqs)
            g = r.graphs
            for _ in range(3): g.replay(packed, mx)
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(50): g.replay(packed, mx)
            b.record(); b.synchronize(); graph_ms = a.elapsed_time(b) / 50
            with profile(activities=[ProfilerActivity.CUDA]) as prof2:
                for _ in range(20): g.replay(packed, mx)
                torch.cuda.synchronize()
            gr = kernels(prof2)
            hidden = g.outputs[:bs]
            batch = r.prepare_sample(seqs)
            for _ in range(3): r.sampler(r.model.compute_logits(hidden), batch)
            torch.cuda.synchronize(); a.record()
            for _ in range(50): r.sampler(r.model.compute_logits(hidden), batch)
            b.record(); b.synchronize(); head_ms = a.elapsed_time(b) / 50
        row = {"batch": bs, "step_ms": round(step_ms, 4), "graph_replay_ms": round(graph_ms, 4),
               "graph_kernel_sum_ms": round(gr[0] / 1000 / 20, 4), "graph_kernel_union_ms": round(gr[1] / 1000 / 20, 4),
               "graph_kernels_per_replay": gr[5] / 20,
               "graph_by_category_ms": {k: round(v / 1000 / 20, 4) for k, v in sorted(gr[3].items(), key=lambda x: -x[1])},
               "head_and_sampler_ms_back_to_back": round(head_ms, 4),
               "step_kernel_sum_ms": round(st[0] / 1000 / 20, 4), "step_kernel_union_ms": round(st[1] / 1000 / 20, 4),
               "step_span_ms": round(st[2] / 1000 / 20, 4), "step_kernels": st[5] / 20,
               "step_by_category_ms": {k: round(v / 1000 / 20, 4) for k, v in sorted(st[3].items(), key=lambda x: -x[1])}}
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
        for s in seqs: llm.abort(s)
        json.dump(res, open(out, "w"), indent=1)
    llm.close()

if __name__ == "__main__":
    main(sys.argv[1])
