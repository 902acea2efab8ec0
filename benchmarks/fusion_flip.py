"""Batch-1 latency with section 11.2's one-row choices as measured, then with one choice flipped, in one process.

    python benchmarks/fusion_flip.py OUT.json [prologue ...]      (needs a CUDA GPU)

One engine (max_model_len 4096, as `python -m nanoengine.bench`). Its start-up choices are kept; latency is measured
(chapter 13's `measure_latency`, three times); then for the named prologues (default: silu) the one-row choice is
flipped, the CUDA graphs are recaptured and latency measured again; then the choices are put back, the graphs
recaptured once more and latency measured a third time, so a recapture alone is seen not to move it."""
import gc
import json
import sys

import torch

from nanoengine import LLM
from nanoengine.bench import ensure_checkpoint, measure_latency, provenance
from nanoengine.engine.cuda_graphs import CUDAGraphDecoder
from nanoengine.kernels import fused


def main(path: str, prologues: list[str]) -> dict:
    llm = LLM(ensure_checkpoint("qwen3-0.6b"), max_model_len=4096)
    r, cfg = llm.model_runner, llm.config

    def recapture() -> None:
        r.graphs = None
        gc.collect()
        torch.cuda.empty_cache()
        r.graphs = CUDAGraphDecoder(
            r.model, max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len, block_size=r.block_size,
            hidden_size=cfg.hf_config.hidden_size, dtype=r.dtype, device=r.device, step_context=r.step,
        )

    def latency() -> list[float]:
        return [round(measure_latency(llm)["ms_per_token"], 4) for _ in range(3)]

    one_row = {k: v for k, v in fused._USE_FUSED.items() if k[1] == 1}
    out = {"provenance": provenance(), "fused_report": r.fused_report,
           "one_row_choices": {" ".join(map(str, k[:4])): v for k, v in one_row.items()}}
    out["as_chosen_ms"] = latency()
    flipped = [k for k in one_row if k[0] in prologues]
    for k in flipped:
        fused._USE_FUSED[k] = not one_row[k]
    recapture()
    out["flipped"] = {" ".join(map(str, k[:4])): fused._USE_FUSED[k] for k in flipped}
    out["flipped_ms"] = latency()
    fused._USE_FUSED.update(one_row)
    recapture()
    out["as_chosen_again_ms"] = latency()
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k not in ("provenance", "fused_report")}, indent=1))
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["silu"])
