"""Tensor parallelism on two GPUs: the bench workload and batch-1 latency at tp=1 and tp=2, and the all-reduces.

Each engine runs in a fresh process (`python -m nanoengine.bench`); then two processes time NCCL all-reduces of the
sizes a Qwen3-0.6B step sends, eagerly and replayed from a CUDA graph (decode steps replay graphs). Writes one JSON:
keys `tp1` and `tp2` (the harness's own result dicts), `allreduce`, `provenance`.

    python3 benchmarks/tp_scaling.py benchmarks/h200x2.json
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
HIDDEN, LAYERS = 1024, 28  # Qwen3-0.6B
BATCHES = [1, 8, 64, 256]


def run_bench(tp: int, out: Path, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "nanoengine.bench", "--throughput", "--latency", "--profile",
           "--engine-json", json.dumps({"tensor_parallel_size": tp}), "--out", str(out)]
    print(" ".join(cmd), flush=True)
    t0 = time.monotonic()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    subprocess.run(cmd, check=True, timeout=timeout, cwd=REPO, env=env)
    result = json.loads(out.read_text())
    result["process_seconds"] = round(time.monotonic() - t0, 1)  # start-up, runs and exit together
    return result


def _time_one_shot(x: torch.Tensor, n: int, start, end) -> float | str:
    """PyTorch's one-shot all-reduce over symmetric memory (peer-to-peer loads over NVLink, no
    multicast), replayed from a CUDA graph: µs per all-reduce, or why it could not run."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
        group = dist.group.WORLD
        buf = symm_mem.empty(x.shape, dtype=x.dtype, device=x.device)
        symm_mem.rendezvous(buf, group)
        buf.copy_(x)
        expected = x * 2
        name = group.group_name
        out = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name)
        torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(n):
                out = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name)
        graph.replay()
        torch.cuda.synchronize()
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
        return round(start.elapsed_time(end) * 1000 / (20 * n), 2)
    except Exception as e:  # not every build or machine supports it
        return f"{type(e).__name__}: {e}"[:300]


def _time_allreduces(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    results = {}
    for batch in BATCHES:
        x = torch.randn(batch, HIDDEN, dtype=torch.bfloat16, device="cuda")
        for _ in range(20):
            dist.all_reduce(x)
        n = 2 * LAYERS
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            for _ in range(n):
                dist.all_reduce(x)
        end.record()
        end.synchronize()
        eager_us = start.elapsed_time(end) * 1000 / (20 * n)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                dist.all_reduce(x)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            for _ in range(n):
                dist.all_reduce(x)
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        graph_us = start.elapsed_time(end) * 1000 / (20 * n)
        results[str(batch)] = {"bytes": batch * HIDDEN * 2, "eager_us": round(eager_us, 2),
                               "graph_us": round(graph_us, 2),
                               "one_shot_graph_us": _time_one_shot(x, n, start, end)}
        del graph
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def time_allreduces() -> dict:
    from nanoengine.utils.dist import free_port
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_time_allreduces, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = queue.get(timeout=300)
    for p in procs:
        p.join(60)
    return {"per_step": 2 * LAYERS, "hidden": HIDDEN, "dtype": "bfloat16", "by_batch": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per engine process")
    parser.add_argument("--skip-allreduce", action="store_true")
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        sys.exit("needs two GPUs")
    sys.path.insert(0, str(REPO))
    from nanoengine.bench import provenance
    result = {"provenance": provenance()}
    result["provenance"]["num_gpus"] = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as tmp:
        for tp in (1, 2):
            result[f"tp{tp}"] = run_bench(tp, Path(tmp) / f"tp{tp}.json", args.timeout)
            Path(args.out).write_text(json.dumps(result, indent=2))
    if not args.skip_allreduce:
        result["allreduce"] = time_allreduces()
    t1, t2 = result["tp1"], result["tp2"]
    result["tp2_over_tp1"] = {
        "throughput": round(t2["throughput"]["output_tok_per_s"] / t1["throughput"]["output_tok_per_s"], 3),
        "batch1_ms_per_token": round(t2["latency"]["ms_per_token"] / t1["latency"]["ms_per_token"], 3),
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result["tp2_over_tp1"]), json.dumps(result.get("allreduce", {})))


if __name__ == "__main__":
    main()
