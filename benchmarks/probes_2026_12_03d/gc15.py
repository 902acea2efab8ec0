"""Python's garbage collector during the bench's timed run: collections per generation and their milliseconds,
with and without gc.freeze() after start-up (argv[2] == 'freeze')."""
import gc, json, sys, time
from nanoengine import LLM
from nanoengine.bench import ensure_checkpoint, measure_throughput
llm = LLM(ensure_checkpoint("qwen3-0.6b"), max_model_len=4096)
if sys.argv[2] == "freeze":
    gc.collect(); gc.freeze()
stats = {0: [0, 0.0, 0.0], 1: [0, 0.0, 0.0], 2: [0, 0.0, 0.0]}
t = {}
def cb(phase, info):
    if phase == "start":
        t["s"] = time.perf_counter()
    else:
        s = stats[info["generation"]]; d = time.perf_counter() - t["s"]; s[0] += 1; s[1] += d; s[2] = max(s[2], d)
gc.callbacks.append(cb)
r = measure_throughput(llm)
out = {"mode": sys.argv[2], "tracked": len(gc.get_objects()), "frozen": gc.get_freeze_count(),
       "gc": {g: {"collections": n, "ms": round(1000 * s, 1), "longest_ms": round(1000 * m, 1)} for g, (n, s, m) in stats.items()},
       "output_tok_per_s": round(r["output_tok_per_s"]), "prefill_seconds": round(r["prefill_seconds"], 3),
       "decode_seconds": round(r["decode_seconds"], 3), "prefill_step_ms": r["prefill_step_ms"]}
print(json.dumps(out), flush=True)
json.dump(out, open(sys.argv[1], "w"))
