"""The load generator's own ceiling, for section 15.3: run_rate against a server with no engine.

Starts `nanoengine.serving.load.run_paced_server` (every stream: first token after --ttft seconds, then one every
--itl seconds, no model, no tokenizer), offers serve_h200.json's workload at each rate from one client process and
from several, and writes what the client measured beside the pace it should have measured, with how busy the
busiest client process was:

    python3 benchmarks/load_client.py benchmarks/host_load_client.json

Whatever TTFT beyond --ttft, or ITL beyond --itl, a point shows is the client's own (or the machine's: the paced
server is a Python process too, and shares the cores).
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nanoengine.bench import provenance  # noqa: E402
from nanoengine.serving.load import report, run_rate  # noqa: E402
from nanoengine.utils.dist import free_port  # noqa: E402


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), which platform.processor() leaves empty on Linux."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def start_paced_server(port: int, ttft: float, itl: float) -> subprocess.Popen:
    code = f"from nanoengine.serving.load import run_paced_server; run_paced_server({port}, {ttft}, {itl})"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=2)  # 404 is fine: it answers
            return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the paced server did not start")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="where to write the JSON")
    p.add_argument("--rates", default="16,32,64,96,128", help="offered requests per second, comma-separated")
    p.add_argument("--workers", default="1,2", help="client processes to try, comma-separated")
    p.add_argument("--seconds", type=float, default=4.0, help="arrival window per rate")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--ttft", type=float, default=0.010, help="the paced server's time to first token (s)")
    p.add_argument("--itl", type=float, default=0.004, help="the paced server's gap between tokens (s)")
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    workers = [int(w) for w in args.workers.split(",")]
    port = free_port()
    server = start_paced_server(port, args.ttft, args.itl)
    runs = []
    try:
        for num_workers in workers:
            points = []
            for i, rate in enumerate(rates):
                point = asyncio.run(run_rate(f"http://127.0.0.1:{port}", "paced", rate, int(rate * args.seconds),
                                             args.prompt_len, args.max_tokens, 10_000, seed=i,
                                             num_workers=num_workers))
                print(f"{num_workers} client process(es): {report(point)}", flush=True)
                points.append(point)
            runs.append({"num_workers": num_workers, "points": points})
    finally:
        server.terminate()
        server.wait(30)
    result = {"what": "run_rate (nanoengine.serving.load) against run_paced_server: a server with no engine that "
                      "paces every stream exactly; what the client measures beyond the pace is its own (or the "
                      "shared cores')", "provenance": {**provenance(), "cpu_model": cpu_model(), "cpu_count": os.cpu_count()},
              "pace": {"ttft": args.ttft, "itl": args.itl},
              "workload": {"prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                           "arrivals": "Poisson (open loop)", "seconds_per_rate": args.seconds},
              "runs": runs}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
