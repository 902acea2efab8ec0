"""Per-phase host time of a step (batch 1 and 16k-token prefill), with the GPU busy (as run) and
idle (synchronize before each step); and cudaGraphLaunch of the batch-1 graph idle vs in flight."""
import os, time, statistics as st
import torch
from nanoengine import LLM, SamplingParams
from nanoengine.bench import ensure_checkpoint, bench_workload
from nanoengine.engine.cuda_graphs import CUDAGraphDecoder

llm = LLM(ensure_checkpoint("qwen3-0.6b"), max_model_len=4096)
mr = llm.model_runner
acc = {}
def timed(obj, name, key):
    f = getattr(obj, name)
    def w(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc.setdefault(key, []).append(time.perf_counter() - t); return r
    setattr(obj, name, w)
for n in ("prepare_decode", "prepare_prefill", "prepare_sample", "_sample", "_step"):
    timed(mr, n, n)
timed(mr.model, "compute_logits", "logits")
timed(mr.model, "forward", "forward")
timed(mr.graphs, "replay", "replay")
gl = torch.cuda.CUDAGraph.replay
def glw(self):
    t = time.perf_counter(); gl(self); acc.setdefault("graphlaunch", []).append(time.perf_counter() - t)
torch.cuda.CUDAGraph.replay = glw
sync = [False]
inner = mr._step
def stepw(*a, **k):
    if sync[0]: torch.cuda.synchronize()
    return inner(*a, **k)
mr._step = stepw
def report(tag):
    print(tag, {k: (len(v), round(1e3 * st.median(v), 3)) for k, v in acc.items()}, flush=True)
    acc.clear()
one = SamplingParams(max_tokens=300, ignore_eos=True, temperature=0.6)
pre = SamplingParams(max_tokens=1, ignore_eos=True)
llm.generate([list(range(1, 101))], one, use_tqdm=False)
llm.generate(bench_workload(256, seed=11)[0], pre, use_tqdm=False)
for s in (False, True):
    sync[0] = s; acc.clear()
    llm.generate([list(range(2, 102))], one, use_tqdm=False); report(f"batch1 sync={s}")
    llm.generate(bench_workload(256, seed=12 + s)[0], pre, use_tqdm=False)
    print("  prefill steps ms", [round(1e3 * x, 1) for x in acc["_step"]], "fwd", [round(1e3 * x, 1) for x in acc["forward"]])
    report(f"prefill sync={s}")
sync[0] = False
g = next(v for (bs, k), v in mr.graphs.graphs.items() if bs == 1)
idle, busy = [], []
for _ in range(50):
    torch.cuda.synchronize(); t = time.perf_counter(); gl(g); idle.append(time.perf_counter() - t)
    t = time.perf_counter(); gl(g); busy.append(time.perf_counter() - t)
    t = time.perf_counter(); gl(g); gl(g); gl(g); busy.append((time.perf_counter() - t) / 3)
torch.cuda.synchronize()
print("graph launch ms idle", round(1e3 * st.median(idle), 3), "in flight", round(1e3 * st.median(busy), 3),
      "nodes?", getattr(g, "debug_dump", None) is not None)
t = time.perf_counter(); [gl(g) for _ in range(100)]; t1 = time.perf_counter() - t; torch.cuda.synchronize(); t2 = time.perf_counter() - t
print("100 back-to-back launches: host", round(t1 * 10, 3), "ms each; GPU done at", round(t2 * 10, 3), "ms each")
llm.close()
