"""Host bookkeeping per step, nanoengine vs nano-vllm, on the bench workload without a model.

Both engines' own scheduler, block manager and runner input packing (prepare_prefill,
prepare_decode, prepare_sample) are driven in lockstep (a step of one, then a step of the other)
on the same 256 requests, with fabricated tokens instead of a model; both produce the 133,966
output tokens. nano-vllm is not part of this repository: pass the directory of its source (the
one that holds the `nanovllm` package), e.g.

    git --git-dir=/path/to/nano-vllm.git archive HEAD | tar x -C /tmp/nanovllm
    python benchmarks/host_vs_nanovllm.py /tmp/nanovllm --repeats 5

nano-vllm is used unmodified. Three things stand in for what a CPU-only machine lacks: a stub
`flash_attn` module (its attention layer imports it; nothing here calls it), a plain namespace
as its scheduler's config (its Config reads a Hugging Face config from a model directory), and,
inside its model runner only, `torch.tensor(..., pin_memory=True).cuda(non_blocking=True)`
becomes a plain CPU tensor (ours builds plain CPU tensors on a CPU device too).
"""
import argparse
import json
import platform
import sys
import types
from itertools import zip_longest
from pathlib import Path
from time import perf_counter_ns

import torch

from nanoengine.bench import (
    H200_NUM_KV_BLOCKS, HOST_PHASES, HostStep, bench_workload, host_steps, host_workload,
    median_of, provenance, summarize_host,
)


def import_nanovllm(source: Path) -> types.SimpleNamespace:
    """nano-vllm's Scheduler, Sequence, SamplingParams and ModelRunner, importable on a CPU."""
    if not (source / "nanovllm" / "engine" / "scheduler.py").exists():
        raise SystemExit(f"{source} does not hold nano-vllm (nanovllm/engine/scheduler.py)")
    sys.path.insert(0, str(source))
    if "flash_attn" not in sys.modules:
        stub = types.ModuleType("flash_attn")
        stub.flash_attn_varlen_func = stub.flash_attn_with_kvcache = None
        sys.modules["flash_attn"] = stub
    from nanovllm.engine import model_runner
    from nanovllm.engine.scheduler import Scheduler
    from nanovllm.engine.sequence import Sequence
    from nanovllm.sampling_params import SamplingParams
    from nanovllm.utils.context import reset_context

    shim = types.ModuleType("torch_on_host")
    shim.__dict__.update(torch.__dict__)
    shim.tensor = _HostTensor.make
    model_runner.torch = shim  # its model runner's module only
    return types.SimpleNamespace(
        Scheduler=Scheduler, Sequence=Sequence, SamplingParams=SamplingParams,
        ModelRunner=model_runner.ModelRunner, reset_context=reset_context,
    )


class _HostTensor:
    """`torch.tensor(values, pin_memory=True).cuda(non_blocking=True)` as a plain CPU tensor."""

    @staticmethod
    def make(data, *, pin_memory: bool = False, **kwargs) -> torch.Tensor:
        return torch.tensor(data, **kwargs)


def _no_copy(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Tensor.cuda on a machine without CUDA: the tensor stays where it is."""
    return self


def nanovllm_workload(nv, num_seqs: int, max_input_len: int, max_output_len: int, *,
                      num_kvcache_blocks: int, kvcache_block_size: int = 256,
                      max_num_seqs: int = 512, max_num_batched_tokens: int = 16384):
    """nano-vllm's scheduler with the workload queued, and a model-less runner of theirs."""
    config = types.SimpleNamespace(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, eos=-1,
        kvcache_block_size=kvcache_block_size, num_kvcache_blocks=num_kvcache_blocks,
    )
    scheduler = nv.Scheduler(config)
    prompts, params = bench_workload(num_seqs, max_input_len, max_output_len)
    seqs = [
        nv.Sequence(p, nv.SamplingParams(sp.temperature, sp.max_tokens, sp.ignore_eos))
        for p, sp in zip(prompts, params)
    ]
    for seq in seqs:
        scheduler.add(seq)
    runner = nv.ModelRunner.__new__(nv.ModelRunner)  # no model, no GPU: the packing methods only
    runner.block_size = kvcache_block_size
    return scheduler, runner, seqs


def nanovllm_steps(nv, scheduler, runner):
    """nano-vllm's step without the model: schedule, pack, postprocess fabricated tokens."""
    clock = perf_counter_ns
    while not scheduler.is_finished():
        t0 = clock()
        seqs, is_prefill = scheduler.schedule()
        t1 = clock()
        if is_prefill:
            runner.prepare_prefill(seqs)
        else:
            runner.prepare_decode(seqs)
        t2 = clock()
        runner.prepare_sample(seqs)
        nv.reset_context()
        t3 = clock()
        token_ids = [seq.num_tokens % 10_000 for seq in seqs]
        t4 = clock()
        scheduler.postprocess(seqs, token_ids, is_prefill)
        t5 = clock()
        yield HostStep(is_prefill, len(seqs), 0, t1 - t0, t2 - t1, t3 - t2, t5 - t4)


def lockstep(nv, args) -> tuple[dict, dict]:
    """One run of each engine over the whole workload, a step of one then a step of the other."""
    sizes = (args.num_seqs, args.max_input_len, args.max_output_len)
    kw = {"num_kvcache_blocks": args.num_kvcache_blocks}
    theirs = nanovllm_workload(nv, *sizes, **kw)
    ours = host_workload(*sizes, **kw)
    logs: tuple[list[HostStep], list[HostStep]] = ([], [])
    steps = zip_longest(nanovllm_steps(nv, *theirs[:2]), host_steps(*ours[:2]))
    for theirs_step, ours_step in steps:
        if theirs_step is not None:
            logs[0].append(theirs_step)
        if ours_step is not None:
            logs[1].append(ours_step)
    expected = sum(p.max_tokens for p in bench_workload(*sizes)[1])
    for name, (_, _, seqs) in (("nano-vllm", theirs), ("nanoengine", ours)):
        produced = sum(seq.num_completion_tokens for seq in seqs)
        if produced != expected:
            raise RuntimeError(f"{name} produced {produced} output tokens, expected {expected}")
    return (
        {"output_tokens": expected, **summarize_host(logs[0])},
        {"output_tokens": expected, **summarize_host(logs[1])},
    )


def cpu_model() -> str:
    """The CPU's model name as Linux reports it (platform.processor() often says only x86_64)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def report(theirs: dict, ours: dict) -> None:
    """Print both per-step costs, by phase, and their ratio."""
    for kind in ("prefill", "decode"):
        steps = f"nano-vllm {theirs[kind]['steps']}, nanoengine {ours[kind]['steps']}"
        print(f"{kind} (steps: {steps})")
        for field in ("us_per_step", *(f"{p}_us" for p in HOST_PHASES)):
            a, b = theirs[kind][field], ours[kind][field]
            ratio = f"{b / a:5.2f}x" if a else "   -  "
            print(f"  {field:16s} nano-vllm {a:9.1f} us   nanoengine {b:9.1f} us   {ratio}")
        a = theirs[kind]["schedule_us"] + theirs[kind]["postprocess_us"]
        b = ours[kind]["schedule_us"] + ours[kind]["postprocess_us"]
        field = "schedule+post"
        print(f"  {field:16s} nano-vllm {a:9.1f} us   nanoengine {b:9.1f} us   {b / a:5.2f}x")
    a, b = theirs["total_ms"], ours["total_ms"]
    print(f"whole run: nano-vllm {a:.1f} ms, nanoengine {b:.1f} ms, {b / a:.2f}x")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("nanovllm_source", type=Path, help="directory holding nano-vllm's `nanovllm`")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--num-kvcache-blocks", type=int, default=H200_NUM_KV_BLOCKS)
    p.add_argument("--out", type=Path, help="write the medians as JSON here")
    args = p.parse_args(argv)
    info = {**provenance(), "cpu": cpu_model(), "nano-vllm source": str(args.nanovllm_source)}
    nv = import_nanovllm(args.nanovllm_source)
    torch.Tensor.cuda = _no_copy  # nano-vllm's runner copies to the GPU; this process has none
    runs = [lockstep(nv, args) for _ in range(args.repeats)]
    theirs, ours = median_of([r[0] for r in runs]), median_of([r[1] for r in runs])
    print(f"median of {args.repeats} lockstep runs, {ours['output_tokens']:,} output tokens each")
    report(theirs, ours)
    result = {"provenance": info, "repeats": args.repeats, "nano-vllm": theirs, "nanoengine": ours}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
