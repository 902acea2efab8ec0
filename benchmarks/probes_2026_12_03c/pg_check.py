import os, sys, time, random, json
import torch
from nanoengine import LLM, SamplingParams
from nanoengine.bench import ensure_checkpoint
path = ensure_checkpoint("qwen3-0.6b")
random.seed(1)
base = [random.randint(1, 5000) for _ in range(700)]
prompts = []
for i in range(48):
    n = random.randint(30, 900)
    p = (base[:random.randint(256, 600)] if i % 3 == 0 else []) + [random.randint(1, 5000) for _ in range(n)]
    prompts.append(p)
params = [SamplingParams(temperature=0.0, max_tokens=random.randint(5, 40), ignore_eos=True) for _ in prompts]
res = {}
for flag in ("1", "0"):
    os.environ["NANOENGINE_PREFILL_GRAPHS"] = flag
    t = time.perf_counter()
    llm = LLM(path, max_model_len=4096, max_num_batched_tokens=1024, max_num_seqs=16, gpu_memory_utilization=0.5)
    r = llm.model_runner
    print(flag, "start-up s", round(time.perf_counter() - t, 1), "pieces", None if r.prefill_graphs is None else len(r.prefill_graphs.pieces),
          "kv blocks", r.num_kvcache_blocks, "peak act MB", r.peak_activation_bytes >> 20, flush=True)
    out = llm.generate(prompts, params, use_tqdm=False)
    out2 = llm.generate(prompts, params, use_tqdm=False)  # prefix hits
    full = sum(1 for x in llm.trace if x.is_prefill and x.num_tokens == 1024)
    mixed = sum(1 for x in llm.trace if x.is_prefill and x.num_tokens == 1024 and x.num_seqs > 1)
    print(flag, "full prompt steps", full, "prefix-cached blocks max", max(x.num_blocks_cached for x in llm.trace), flush=True)
    res[flag] = [o["token_ids"] for o in out] + [o["token_ids"] for o in out2]
    llm.close()
    free, total = torch.cuda.mem_get_info()
    print(flag, "after close: allocated", torch.cuda.memory_allocated(), "reserved", torch.cuda.memory_reserved(), flush=True)
same = sum(a == b for a, b in zip(res["1"], res["0"]))
print("identical sequences", same, "of", len(res["1"]))
for i, (a, b) in enumerate(zip(res["1"], res["0"])):
    if a != b:
        print("first diff at", i, a[:10], b[:10]); break
