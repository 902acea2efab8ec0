"""A 64-prompt generate under torch.cuda.set_sync_debug_mode("warn"): does a step synchronize anywhere hidden?"""
import warnings, traceback, collections, torch, time
from nanoengine import LLM, SamplingParams
from nanoengine.bench import ensure_checkpoint, bench_workload
llm = LLM(ensure_checkpoint("qwen3-0.6b"), max_model_len=4096)
prompts, _ = bench_workload(seed=3)
sp = SamplingParams(max_tokens=3, ignore_eos=True)
llm.generate(prompts[:4], sp, use_tqdm=False)
seen = collections.Counter()
def hook(message, category, filename, lineno, file=None, line=None):
    st = "".join(traceback.format_stack(limit=9)[:-1])
    seen[st[-900:]] += 1
warnings.showwarning = hook
torch.cuda.set_sync_debug_mode("warn")
t = time.perf_counter()
llm.generate(prompts[:64], sp, use_tqdm=False)
torch.cuda.set_sync_debug_mode(0)
print("run", time.perf_counter() - t, "syncs", sum(seen.values()))
for st, n in seen.most_common(6): print("=====", n, "\n", st)
