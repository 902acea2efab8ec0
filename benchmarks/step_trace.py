"""Every step of one bench-workload run: kind, tokens, sequences and wall seconds, from the engine's own trace.

    python benchmarks/step_trace.py OUT.json      (needs a CUDA GPU; engine switches through the environment)

One fresh engine (max_model_len 4096, as `python -m nanoengine.bench`), the warm-up request, then the timed
`generate` of `nanoengine.bench.measure_throughput`; the steps written are the timed run's. A step's seconds run from
the start of `LLMEngine.step` to its tokens applied, so with async scheduling they include launching the next step;
what the run spends outside its steps (checking the prompts, the loop, the outputs) is `seconds` minus their sum."""
import json
import sys

from nanoengine import LLM
from nanoengine.bench import ensure_checkpoint, measure_throughput, provenance


def main(path: str) -> dict:
    llm = LLM(ensure_checkpoint("qwen3-0.6b"), max_model_len=4096)
    throughput = measure_throughput(llm)
    timed = list(llm.trace)[-(throughput["prefill_steps"] + throughput["decode_steps"]):]  # not the warm-up's
    steps = [[r.step, r.is_prefill, r.num_tokens, r.num_seqs, r.seconds] for r in timed]
    data = {"provenance": provenance(), "throughput": throughput,
            "fields": ["step", "is_prefill", "num_tokens", "num_seqs", "seconds"], "steps": steps}
    with open(path, "w") as f:
        json.dump(data, f)
    print(json.dumps(throughput))
    return data


if __name__ == "__main__":
    main(sys.argv[1])
