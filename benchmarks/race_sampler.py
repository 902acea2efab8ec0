"""Time section 11.4's one-pass sampler against chapter 06's PyTorch path, both through `Sampler`
(`Sampler(one_pass=False)` against `Sampler()`), and test the kernel's frequencies on the whole vocabulary.

    python benchmarks/race_sampler.py OUT.json      (needs a CUDA GPU)

Every row at temperature 0.6, bf16 logits of Qwen3's 151,936 tokens; 50 calls back to back after a warm-up, timed
by CUDA events, so that a path bounded by its launches is timed as the engine runs it. The chi-square test draws
102,400 tokens from 20 logits, each repeated over the vocabulary, at temperature 0.8. `kernel_only` times the two
kernels alone, 20 calls captured in a CUDA graph and replayed, with the noise's logarithms by the GPU's approximate
instruction (as the engine runs them) and by libdevice's exact functions (the kernel before session 16)."""
import json
import math
import sys

import torch

from nanoengine.bench import provenance
from nanoengine.kernels.race_kernel import RACE_CHUNK, _race_chunk_kernel, _race_pick_kernel, race_sample
from nanoengine.layers.sampler import Sampler, SamplingBatch
from nanoengine.sampling_params import SamplingParams

VOCAB, BATCHES, CALLS = 151_936, (1, 8, 32, 128, 256), 50


def _per_call_us(fn) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CALLS):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / CALLS


def _chi_square() -> dict:
    torch.manual_seed(0)
    z = torch.randn(20, device="cuda") * 1.5
    logits = z.repeat(VOCAB // 20 + 1)[:VOCAB].to(torch.bfloat16).expand(4096, VOCAB).contiguous()
    temps = torch.full((4096,), 0.8, device="cuda")
    counts = torch.zeros(20, dtype=torch.float64, device="cuda")
    for i in range(25):
        counts += torch.bincount(race_sample(logits, temps, 2**40 + i) % 20, minlength=20).double()
    p = torch.softmax(logits[0].double() / 0.8, dim=0)
    q = torch.zeros(20, dtype=torch.float64, device="cuda").index_add_(
        0, torch.arange(VOCAB, device="cuda") % 20, p)
    expected = counts.sum() * q
    stat = (((counts - expected) ** 2) / expected).sum().item()
    # the chi-square survival function for 19 degrees of freedom (odd: erfc plus a finite sum)
    x, term, total = stat / 2, 1.0, 0.0
    for k in range(1, 10):
        term *= x / (k - 0.5)
        total += term
    p_value = math.erfc(math.sqrt(x)) + math.exp(-x) / math.sqrt(math.pi * x) * total
    return {"statistic": stat, "dof": 19, "p_value": p_value, "draws": int(counts.sum().item())}


def _graph_us(fn, calls: int = 20) -> float:
    """Microseconds per call of `fn`, `calls` of them captured in one CUDA graph, best of five replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / calls)
    return best


def kernel_only() -> list[dict]:
    """GPU time of the chunk and pick kernels per call, the fast and the exact logarithms."""
    import triton
    rows = []
    for b in BATCHES:
        logits = torch.randn(b, VOCAB, device="cuda", dtype=torch.bfloat16) * 3
        temps = torch.full((b,), 0.6, device="cuda")
        chunks = triton.cdiv(VOCAB, RACE_CHUNK)
        best = torch.empty(b, chunks, device="cuda")
        index = torch.empty(b, chunks, dtype=torch.int32, device="cuda")
        out = torch.empty(b, dtype=torch.int64, device="cuda")
        row = {"batch": b}
        for key, fast in (("exact_log_us", False), ("fast_log_us", True)):
            def call(fast=fast):
                _race_chunk_kernel[(b, chunks)](
                    logits, temps, best, index, 12345, VOCAB, logits.stride(0), chunks,
                    CHUNK=RACE_CHUNK, FAST=fast, num_warps=4,
                )
                _race_pick_kernel[(b,)](best, index, out, chunks, CHUNKS_PAD=triton.next_power_of_2(chunks))
            row[key] = round(_graph_us(call), 2)
        rows.append(row)
    return rows


def measure() -> dict:
    """Per-call times of both paths for each batch size, and the kernel's chi-square test."""
    samplers, timings = {"torch_us": Sampler(one_pass=False), "kernel_us": Sampler()}, []
    for b in BATCHES:
        logits = torch.randn(b, VOCAB, device="cuda", dtype=torch.bfloat16) * 3
        batch = SamplingBatch.from_params([SamplingParams(temperature=0.6)] * b, [0] * b, "cuda")
        row = {"batch": b}
        for key, sampler in samplers.items():
            row[key] = round(_per_call_us(lambda: sampler(logits, batch)), 2)
        timings.append(row)
    return {"timings": timings, "kernel_only": kernel_only(), "chi_square": _chi_square()}


if __name__ == "__main__":
    results = {"provenance": provenance(), "what": __doc__.split("\n\n")[0], **measure()}
    json.dump(results, open(sys.argv[1], "w"), indent=1)
    print(json.dumps(results, indent=1))
