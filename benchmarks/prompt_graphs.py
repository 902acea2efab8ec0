"""Prompt steps eagerly and in pieces (section 11.5), on a GPU machine.

One engine on the random-weight Qwen3-0.6B checkpoint. For each prompt length, one prompt step at a time: its wall
time with the prompt graphs lent out (eager) and replayed (pieces), and the time its GPU kernels take (torch.profiler).
Then the logits of both paths on the same steps, a fresh prompt and one over a cached prefix beside decode rows; the
host time of one FlashAttention varlen call through flash-attn's Python function and through its extension's entry;
and how long capturing the pieces takes:

    python3 benchmarks/prompt_graphs.py benchmarks/prompt_graphs.json
"""
import argparse
import json
import math
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nanoengine import LLM  # noqa: E402
from nanoengine.bench import ensure_checkpoint, provenance  # noqa: E402
from nanoengine.engine.sequence import Sequence  # noqa: E402
from nanoengine.utils.context import Context  # noqa: E402

LENGTHS = [16, 64, 128, 256, 512, 1024, 2048]


@contextmanager
def pieces_off(runner):
    """Prompt steps run eagerly inside this block."""
    pieces, runner.prompt_graphs = runner.prompt_graphs, None
    try:
        yield
    finally:
        runner.prompt_graphs = pieces


def prompt_seqs(runner, lengths: list[int], first_block: int = 0) -> list[Sequence]:
    """Sequences of fresh prompts of these lengths, each with KV blocks of its own from `first_block` on."""
    seqs, block = [], first_block
    for i, n in enumerate(lengths):
        seq = Sequence([1 + (i * 131 + j * 7) % 9000 for j in range(n)], block_size=runner.block_size)
        need = math.ceil(n / runner.block_size)
        seq.block_table = list(range(block, block + need))
        block += need
        seq.num_scheduled_tokens = n
        seqs.append(seq)
    return seqs


def step_ms(runner, seqs, reps: int) -> float:
    """Wall milliseconds of one prompt step, launched and collected, averaged over `reps` after a warm-up."""
    for _ in range(3):
        runner.run(seqs, is_prefill=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        runner.run(seqs, is_prefill=True)
    return 1000 * (time.perf_counter() - start) / reps


def gpu_ms(runner, seqs, reps: int = 5) -> float:
    """Milliseconds of GPU kernel time per step (the sum of the kernels' durations under torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    runner.run(seqs, is_prefill=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            runner.run(seqs, is_prefill=True)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / 1000 / reps


def compare(runner, seqs) -> dict:
    """Eager against pieces on the same step: the largest logit difference and whether each argmax agrees."""
    with pieces_off(runner):
        eager = runner.logits(seqs, True)
    pieces = runner.logits(seqs, True)
    return {"max_abs_diff": (eager - pieces).abs().max().item(),
            "argmax_equal": (eager.argmax(-1) == pieces.argmax(-1)).all().item(),
            "logit_scale": eager.abs().max().item()}


def flash_call_us(runner, n: int = 16, calls: int = 2000) -> dict:
    """Host microseconds per FlashAttention varlen call of n tokens, through the Python function and directly."""
    backend, layer = runner.backend, runner.attention_layers[0]
    dev, dt = runner.device, runner.dtype
    q = torch.randn(n, layer.num_heads, layer.head_dim, device=dev, dtype=dt)
    k = torch.randn(n, layer.num_kv_heads, layer.head_dim, device=dev, dtype=dt)
    v = torch.randn_like(k)
    bounds = torch.tensor([0, n], dtype=torch.int32, device=dev)
    ctx = Context(is_prefill=True, cu_seqlens_q=bounds, cu_seqlens_k=bounds, max_seqlen_q=n, max_seqlen_k=n)
    result = {}
    direct = backend._varlen_fwd
    for name, entry in (("python_function", None), ("extension_entry", direct)):
        if name == "extension_entry" and direct is None:
            result[name] = None
            continue
        backend._varlen_fwd = entry
        for _ in range(50):
            backend.prefill(q, k, v, layer.k_cache, layer.v_cache, ctx, layer.scale)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            backend.prefill(q, k, v, layer.k_cache, layer.v_cache, ctx, layer.scale)
        result[name] = 1e6 * (time.perf_counter() - start) / calls
        torch.cuda.synchronize()
    backend._varlen_fwd = direct
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    model = ensure_checkpoint("qwen3-0.6b")
    llm = LLM(str(model), max_model_len=4096)
    runner = llm.model_runner
    steps = []
    for n in LENGTHS:
        seqs = prompt_seqs(runner, [n])
        with pieces_off(runner):
            eager = step_ms(runner, seqs, args.reps)
            eager_gpu = gpu_ms(runner, seqs)
        pieces = step_ms(runner, seqs, args.reps)
        steps.append({"tokens": n, "eager_ms": eager, "pieces_ms": pieces, "gpu_ms": eager_gpu,
                      "pieces_gpu_ms": gpu_ms(runner, seqs)})
        print(f"{n:5d} tokens: eager {eager:6.2f} ms, pieces {pieces:6.2f} ms, GPU kernels {eager_gpu:6.2f} ms",
              flush=True)
    # the same steps through both paths: fresh prompts, and a mixed step (decode rows first, then a prompt
    # chunk over a cached prefix)
    checks = {"fresh prompts 300 + 45 + 170 tokens": compare(runner, prompt_seqs(runner, [300, 45, 170]))}
    cached = prompt_seqs(runner, [700])[0]
    cached.num_cached_tokens, cached.num_scheduled_tokens = 512, 188
    decodes = prompt_seqs(runner, [40, 300], first_block=8)
    for seq in decodes:
        seq.num_cached_tokens, seq.num_scheduled_tokens, seq.is_prefill = seq.num_tokens - 1, 1, False
    checks["2 decode rows + 188 prompt tokens over 512 cached"] = compare(runner, decodes + [cached])
    for name, c in checks.items():
        print(f"{name}: max |diff| {c['max_abs_diff']:.4f} of logits up to {c['logit_scale']:.1f}, "
              f"argmax equal {c['argmax_equal']}")
    flash = flash_call_us(runner)
    print(f"one varlen call of 16 tokens: {flash}")
    pieces = runner.prompt_graphs
    start = time.perf_counter()
    before = torch.cuda.memory_allocated()
    again = runner._capture_prompt_graphs()
    capture_s = time.perf_counter() - start
    capture = {"seconds": capture_s, "num_buckets": len(again.buckets), "num_graphs": again.num_graphs,
               "max_tokens": again.max_tokens, "num_attention_layers": len(runner.attention_layers),
               "bytes_held": torch.cuda.memory_allocated() - before}
    del again
    print(f"capture: {capture}")
    out = {"provenance": provenance(), "model": "random-weight qwen3-0.6b", "engine": {"max_model_len": 4096},
           "what": "one prompt step at a time in one engine: eager (the prompt graphs lent out) against pieces "
                   "(replayed); wall time per step averaged over --reps steps after three warm-ups, GPU kernel "
                   "time per step from torch.profiler",
           "steps": steps, "checks": checks, "flash_varlen_call_us": flash, "capture": capture,
           "buckets": pieces.buckets}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    llm.close()


if __name__ == "__main__":
    main()
