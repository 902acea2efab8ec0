"""Latency under load for section 15.3: TTFT and ITL against the offered request rate, on a GPU machine.

Starts `python -m nanoengine.serve` on the benchmark model (random-weight Qwen3-0.6B unless --model is given),
sweeps offered request rates with open-loop Poisson arrivals (nanoengine.serving.load), and writes JSON with its
provenance. Each point also keeps `server_first_token`: the server's own mean TTFT per first token over the rate,
split into the engine's queue time, its prefill time and the rest (read from /metrics before and after):

    python3 benchmarks/serve_load.py benchmarks/serve_h200.json

Needs fastapi, uvicorn and httpx (the `serve` extra).
"""
import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nanoengine.bench import ensure_checkpoint, provenance  # noqa: E402
from nanoengine.serving.load import report, run_rate, saturation_rate  # noqa: E402
from nanoengine.utils.dist import free_port  # noqa: E402


# `python -m nanoengine.serve`, with the engine loop on a thread of the server's process
IN_THREAD = ("import nanoengine.serve as serve; from nanoengine.serving.engine_loop import EngineLoop; "
             "serve.EngineProcess = EngineLoop; serve.main()")


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not become healthy")


FIRST_TOKEN_METRICS = ("time_to_first_token", "request_queue_time", "request_prefill_time")


def first_token_sums(url: str) -> dict[str, tuple[float, float]]:
    """The server's (sum, count) of its TTFT, queue-time and prefill-time histograms (/metrics)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    return {name: (values.get(f"nanoengine:{name}_seconds_sum", 0.0),
                   values.get(f"nanoengine:{name}_seconds_count", 0.0)) for name in FIRST_TOKEN_METRICS}


def server_means(before: dict, after: dict) -> dict[str, float | None]:
    """Mean seconds per first token between two `first_token_sums`: the server's TTFT (from the request's
    submission to the engine), the engine's queue and prefill, and the rest: the way in (waiting for the engine
    loop to read its inbox, up to one step) and out (the pipe, the reader thread, the event loop)."""
    means = {}
    for name in FIRST_TOKEN_METRICS:
        total, num = (a - b for a, b in zip(after[name], before[name]))
        means[f"{name}_mean"] = total / num if num else None
    parts = [means[f"{name}_mean"] for name in FIRST_TOKEN_METRICS]
    means["rest_mean"] = None if None in parts else parts[0] - parts[1] - parts[2]
    return means


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="where to write the JSON")
    p.add_argument("--model", help="checkpoint directory (default: random-weight --preset)")
    p.add_argument("--preset", default="qwen3-0.6b")
    p.add_argument("--rates", default="1,2,4,8,16,32,48,64,96,128,192,256",
                   help="offered requests per second, comma-separated (up to 256 and beyond)")
    p.add_argument("--stop-after-ttft", type=float, default=30.0, metavar="S",
                   help="skip the higher rates once the median TTFT passes S seconds")
    p.add_argument("--seconds", type=float, default=15.0, help="arrival window per rate")
    p.add_argument("--min-requests", type=int, default=32)
    p.add_argument("--max-requests", type=int, default=3000)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=10_000, help="prompt token ids are drawn below this")
    p.add_argument("--server-args", default="--max-model-len 4096",
                   help="extra flags for python -m nanoengine.serve")
    p.add_argument("--seeds", default=None, metavar="S,S,...",
                   help="one arrival seed per rate (default: each rate's place in the sweep, 0, 1, 2, ...)")
    p.add_argument("--client-workers", type=int, default=1, metavar="N",
                   help="client processes that share the arrivals (each point records how busy the busiest "
                        "was: past nanoengine.serving.load.CLIENT_BUSY_LIMIT it times itself, section 15.3 §4)")
    p.add_argument("--engine-in-thread", action="store_true",
                   help="run the server's engine loop on a thread of the server's process (EngineLoop, "
                        "section 15's first design) instead of in a process of its own (EngineProcess)")
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    if not all(r > 0 for r in rates):
        p.error(f"--rates must be positive numbers, got {args.rates}")
    seeds = list(range(len(rates))) if args.seeds is None else [int(s) for s in args.seeds.split(",")]
    if len(seeds) != len(rates):
        p.error(f"--seeds needs one seed per rate: {len(rates)} rates, {len(seeds)} seeds")
    if args.client_workers < 1:
        p.error(f"--client-workers must be at least 1, got {args.client_workers}")
    model = Path(args.model) if args.model else ensure_checkpoint(args.preset)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(args.out).with_suffix(".server.log")
    server = ["-m", "nanoengine.serve"] if not args.engine_in_thread else ["-c", IN_THREAD]
    cmd = [sys.executable, *server, str(model), "--port", str(port), "--served-model-name", "bench",
           *args.server_args.split()]
    print(" ".join(cmd), flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                    filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    try:
        wait_healthy(url, proc, timeout=900)  # CUDA graphs and compilation take a while
        asyncio.run(run_rate(url, "bench", 8, 32, args.prompt_len, args.max_tokens, args.vocab_size,
                             seed=999))  # warm-up
        points = []
        for i, rate in enumerate(rates):
            n = int(min(args.max_requests, max(args.min_requests, rate * args.seconds)))
            before = first_token_sums(url)
            point = asyncio.run(run_rate(url, "bench", rate, n, args.prompt_len, args.max_tokens,
                                         args.vocab_size, seed=seeds[i], num_workers=args.client_workers))
            point["server_first_token"] = server_means(before, first_token_sums(url))
            points.append(point)
            print(report(point), flush=True)  # failed requests counted, the sweep goes on
            first = point["server_first_token"]
            if first["rest_mean"] is not None:
                print(f"    server side, mean per first token: TTFT {first['time_to_first_token_mean'] * 1e3:.1f} ms = "
                      f"queue {first['request_queue_time_mean'] * 1e3:.1f} + prefill "
                      f"{first['request_prefill_time_mean'] * 1e3:.1f} + in/out {first['rest_mean'] * 1e3:.1f}",
                      flush=True)
            if point["ttft_p50"] is not None and point["ttft_p50"] > args.stop_after_ttft:
                break  # deep past saturation: the next rates only queue longer
        stats = httpx.get(url + "/stats", timeout=30).json()
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    result = {"provenance": provenance(), "model": str(model), "model_name": f"random-weight {args.preset}"
              if not args.model else Path(args.model).name, "server_command": cmd[1:],
              "workload": {"prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                           "arrivals": "Poisson (open loop)", "seconds_per_rate": args.seconds,
                           "client": "httpx on the same machine, streamed, ignore_eos",
                           "client_processes": args.client_workers, "seeds": seeds[:len(points)]},
              "engine": "a thread of the server's process" if args.engine_in_thread
              else "a process of its own",
              "points": points, "saturation_rate": saturation_rate(points), "final_stats": stats}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    num_failed = sum(point["num_failed"] for point in points)
    print(f"saturation at {result['saturation_rate']} requests/s; {num_failed} requests failed; "
          f"wrote {args.out}", flush=True)
    return result


if __name__ == "__main__":
    main()
