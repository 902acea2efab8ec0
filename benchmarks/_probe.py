import json, os
from time import perf_counter
import torch
from nanoengine import LLM, SamplingParams
from nanoengine.bench import ensure_checkpoint
from torch.profiler import profile, ProfilerActivity
llm = LLM(ensure_checkpoint("qwen3-0.6b"), max_model_len=4096)
r = llm.model_runner
seq = llm.add_request(list(range(1, 101)), SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=200))
for _ in range(20): llm.step()
torch.cuda.synchronize()
# host timing of launch and collect separately
import nanoengine.engine.llm_engine as E
tl = {"launch": 0.0, "collect": 0.0, "sched_ahead": 0.0, "post": 0.0}
L, C, SA, PP = r.launch, r.collect, llm.scheduler.schedule_ahead, llm.scheduler.postprocess
def timed(name, f):
    def w(*a, **k):
        t = perf_counter(); out = f(*a, **k); tl[name] += perf_counter() - t; return out
    return w
r.launch, r.collect = timed("launch", L), timed("collect", C)
llm.scheduler.schedule_ahead, llm.scheduler.postprocess = timed("sched_ahead", SA), timed("post", PP)
t = perf_counter()
for _ in range(50): llm.step()
torch.cuda.synchronize(); wall = (perf_counter() - t) / 50
print("b1 step ms", round(wall * 1e3, 3), {k: round(v / 50 * 1e3, 3) for k, v in tl.items()})
r.launch, r.collect, llm.scheduler.schedule_ahead, llm.scheduler.postprocess = L, C, SA, PP
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(20): llm.step()
    torch.cuda.synchronize()
ev = prof.key_averages()
print("gpu ms/step", sum(e.self_device_time_total for e in ev) / 1000 / 20)
for e in sorted(ev, key=lambda e: e.self_device_time_total, reverse=True)[:16]:
    print(f"{e.self_device_time_total/20:8.1f} us/step  n={e.count//20:4d}  {e.key[:90]}")
llm.abort(seq)
