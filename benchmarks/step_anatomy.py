"""Where one engine step's time goes, on the host and on the GPU, at tensor_parallel_size 1 or 2.

For a 16 x 1,024-token prefill step and for batch-1 decode steps it reports: the step's wall time, rank 0's time
inside `launch` and `collect` (un-profiled), the GPU kernel time and the top kernels and host operations (profiled),
and, with two ranks, how long the worker waits for each message and how long its own host work takes. Used in
chapter 14 to find why batch 1 is slower on two GPUs.

    python3 benchmarks/step_anatomy.py --tp 2 --out step_tp2.json
"""
import argparse
import glob
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from time import perf_counter

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]
# imported by every spawned worker (PYTHONPATH is inherited): times the worker's loop, writes it at exit
WORKER_TIMER = '''
import json, os, time
from nanoengine.parallel import workers

_serve = workers.TensorParallelRunner.serve


def serve(self, receive):
    stats = {"recv_wait": [], "step_host": []}

    def timed_receive():
        t = time.perf_counter()
        message = receive()
        stats["recv_wait"].append(time.perf_counter() - t)
        return message

    step = self._step

    def timed_step(*args, **kwargs):
        t = time.perf_counter()
        out = step(*args, **kwargs)
        stats["step_host"].append(time.perf_counter() - t)
        return out

    self._step = timed_step
    try:
        return _serve(self, timed_receive)
    finally:
        with open(os.path.join(os.environ["STEP_ANATOMY_DIR"], f"worker-{os.getpid()}.json"), "w") as f:
            json.dump(stats, f)


workers.TensorParallelRunner.serve = serve
'''


def kernel_summary(prof, steps: int) -> tuple[float, list, list]:
    """GPU kernel ms per step, the top kernels and the top host operations (ms per step, calls per step)."""
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.key.startswith("nccl:")]
    host = [e for e in events if e.device_type != DeviceType.CUDA]
    top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:12]
    top_host = sorted(host, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    return (
        sum(e.self_device_time_total for e in kernels) / 1000 / steps,
        [(e.key[:80], round(e.self_device_time_total / 1000 / steps, 3), e.count // steps) for e in top],
        [(e.key[:80], round(e.self_cpu_time_total / 1000 / steps, 3), e.count // steps) for e in top_host],
    )


class HostTimer:
    """Time rank 0's `launch` and `collect` by wrapping them on the runner instance."""

    def __init__(self, runner):
        self.runner, self.seconds = runner, {"launch": 0.0, "collect": 0.0}
        for name in self.seconds:
            setattr(runner, name, self._wrap(name, getattr(runner, name)))

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            t = perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += perf_counter() - t
        return timed

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)

    def remove(self) -> None:
        for name in self.seconds:
            delattr(self.runner, name)  # the class's own method again


def measure(tp: int, prefill_repeats: int, decode_steps: int) -> dict:
    from nanoengine import LLM, SamplingParams
    from nanoengine.bench import ensure_checkpoint, provenance

    llm = LLM(ensure_checkpoint("qwen3-0.6b"), max_model_len=4096, tensor_parallel_size=tp)
    rng = random.Random(tp)

    def prefill_step() -> float:
        seqs = [llm.add_request([rng.randrange(1, 10_000) for _ in range(1024)],
                                SamplingParams(max_tokens=1, ignore_eos=True)) for _ in range(16)]
        torch.cuda.synchronize()
        t = perf_counter()
        while not all(s.is_finished for s in seqs):
            llm.step()
        torch.cuda.synchronize()
        return perf_counter() - t

    result = {"provenance": provenance() | {"tensor_parallel_size": tp}}
    for _ in range(3):
        prefill_step()  # warm-up: compilation of the prefill shapes
    timer = HostTimer(llm.model_runner)
    walls = [prefill_step() for _ in range(prefill_repeats)]
    result["prefill"] = {"tokens": 16 * 1024, "wall_ms": round(1000 * statistics.median(walls), 3),
                         "host_ms": {k: round(1000 * v / prefill_repeats, 3) for k, v in timer.seconds.items()}}
    timer.remove()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            prefill_step()
    result["prefill"]["kernel_ms"], result["prefill"]["top_kernels"], result["prefill"]["top_host"] = (
        kernel_summary(prof, 3))

    seq = llm.add_request(list(range(1, 101)), SamplingParams(temperature=0.6, ignore_eos=True,
                                                              max_tokens=2 * decode_steps + 100))
    for _ in range(30):
        llm.step()
    timer = HostTimer(llm.model_runner)
    torch.cuda.synchronize()
    t = perf_counter()
    for _ in range(decode_steps):
        llm.step()
    torch.cuda.synchronize()
    wall = (perf_counter() - t) / decode_steps
    result["decode_batch1"] = {"wall_ms": round(1000 * wall, 4),
                               "host_ms": {k: round(1000 * v / decode_steps, 4) for k, v in timer.seconds.items()}}
    timer.remove()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(50):
            llm.step()
        torch.cuda.synchronize()
    d = result["decode_batch1"]
    d["kernel_ms"], d["top_kernels"], d["top_host"] = kernel_summary(prof, 50)
    llm.abort(seq)
    llm.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1, choices=(1, 2))
    parser.add_argument("--prefill-repeats", type=int, default=6)
    parser.add_argument("--decode-steps", type=int, default=200)
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.tp:
        sys.exit(f"needs {args.tp} GPU(s)")
    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "sitecustomize.py").write_text(WORKER_TIMER)
        os.environ["STEP_ANATOMY_DIR"] = tmp
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tmp, str(REPO), os.environ.get("PYTHONPATH")]))
        result = measure(args.tp, args.prefill_repeats, args.decode_steps)
        for path in glob.glob(os.path.join(tmp, "worker-*.json")):
            stats = json.loads(Path(path).read_text())
            last = {k: v[-args.decode_steps:] for k, v in stats.items()}  # the timed decode steps
            result["worker_decode_batch1"] = {f"{k}_median_ms": round(1000 * statistics.median(v), 4)
                                              for k, v in last.items() if v}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
