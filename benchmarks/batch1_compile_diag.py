"""Batch-1 latency: which part of NANOENGINE_COMPILE=0 makes it faster (graphs captured eager, or the pieces outside)."""
import gc, json, os, sys, time
import torch
from nanoengine import LLM
from nanoengine.bench import ensure_checkpoint, measure_latency
from nanoengine.engine.cuda_graphs import CUDAGraphDecoder

t0 = time.time()
llm = LLM(ensure_checkpoint("qwen3-0.6b"), max_model_len=4096)
r, cfg = llm.model_runner, llm.config
print("built", round(time.time() - t0, 1), "s", flush=True)


def recapture(compile_inside: bool):
    r.graphs = None
    gc.collect(); torch.cuda.empty_cache()
    os.environ["NANOENGINE_COMPILE"] = "1" if compile_inside else "0"
    r.graphs = CUDAGraphDecoder(r.model, max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len,
                                block_size=r.block_size, hidden_size=cfg.hf_config.hidden_size, dtype=r.dtype,
                                device=r.device, step_context=r.step)


out = {}
def lat(name):
    out[name] = [round(measure_latency(llm)["ms_per_token"], 4) for _ in range(2)]
    print(name, out[name], flush=True)

lat("A compiled graphs, compiled outside")
os.environ["NANOENGINE_COMPILE"] = "0"
lat("C compiled graphs, eager outside")
recapture(False)
lat("D eager graphs, eager outside")
os.environ["NANOENGINE_COMPILE"] = "1"
lat("B eager graphs, compiled outside")
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "diag_compile.json"), "w"), indent=1)
