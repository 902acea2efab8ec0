"""The GPU check: a short serving sweep, the whole test suite with CUDA visible, then every notebook executed top
to bottom, all cells.

Run it on a machine with a CUDA GPU (and flash-attn, to cover the FlashAttention paths):

    python scripts/gpu_check.py                      # all three parts, writes benchmarks/gpu_check.json
    python scripts/gpu_check.py --part tests         # one part; the other parts' results are kept when the
    python scripts/gpu_check.py --part notebooks     #   summary on disk is of the same commit
    python scripts/gpu_check.py --part serve

The serve part runs benchmarks/serve_load.py (a fresh `python -m nanoengine.serve` on the benchmark model) at a few
offered rates for a few seconds each, with serve_h200.json's workload, and fails when a rate's ITL p50 or TTFT p50 is
more than SERVE_TOLERANCE times the committed sweep's at the same rate, or when a request fails at a rate at or below
the committed saturation rate. The committed sweep is the newest whole one in serve_h200.json measured on a GPU of the
same name (serve_reference), its top level where there is none; the fresh sweep uses as many client processes. It
takes about a minute, most of it the server's start.

nbval skips the `# NBVAL_SKIP` cells that hold the GPU paths, so the notebooks run through nbclient here, every
cell included, each notebook in a fresh kernel with a time limit. `--executed DIR` keeps the executed notebooks;
`scripts/keep_gpu_outputs.py DIR` then copies the GPU cells' outputs into notebooks/ for the site.

Each notebook runs in its own process group, killed with its kernel at `--deadline`, and the summary is written
after every notebook, so a run cut short still records what it did and leaves no kernel behind.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
# Machine-independent tests that need tools a GPU box may lack: the book build (jupyter-book, Chromium) and the
# nbdev export checks. CI runs them on every commit.
NEEDS = {"tests/test_book.py": "jupyter_book", "tests/test_project.py": "nbdev"}


def version_of(module: str) -> str | None:
    """A module's __version__, or None when it does not import."""
    try:
        return __import__(module).__version__
    except Exception:
        return None


# The files whose content a check vouches for. A copy of the repository may report another commit to git (the
# device's copy reports the session's base commit), so the summary records a digest of these files, and --merge
# names the commit whose files have the same digest.
CONTENT_DIRS = ("nanoengine", "notebooks", "tests", "scripts")
CONTENT_SUFFIXES = (".py", ".ipynb")


def content_digest(files: dict[str, bytes]) -> str:
    """One sha256 over the files' paths and contents, in path order."""
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(f"{path}\0{hashlib.sha256(files[path]).hexdigest()}\n".encode())
    return digest.hexdigest()


def checked_files() -> dict[str, bytes]:
    """The content files of this working tree (pyproject.toml and CONTENT_DIRS' .py and .ipynb files)."""
    files = {"pyproject.toml": (ROOT / "pyproject.toml").read_bytes()}
    for folder in CONTENT_DIRS:
        for path in (ROOT / folder).rglob("*"):
            rel = path.relative_to(ROOT).as_posix()
            if path.suffix in CONTENT_SUFFIXES and path.is_file() and "__pycache__" not in rel \
                    and ".ipynb_checkpoints" not in rel:
                files[rel] = path.read_bytes()
    return files


def commit_files(ref: str) -> dict[str, bytes]:
    """The same files as `checked_files`, as committed at `ref`."""
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", ref, "--", "pyproject.toml", *CONTENT_DIRS],
                           capture_output=True, text=True, cwd=ROOT, check=True).stdout.split("\n")
    names = [n for n in names if n == "pyproject.toml" or n.endswith(CONTENT_SUFFIXES)]
    return {n: subprocess.run(["git", "show", f"{ref}:{n}"], capture_output=True, cwd=ROOT, check=True).stdout
            for n in names}


def provenance() -> dict:
    """The GPU, the commit, the date and the versions this check ran with."""
    import torch
    commit = os.environ.get("NANOENGINE_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                                    timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = ""
    return {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
            "num_gpus": torch.cuda.device_count(), "commit": commit or "unknown",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": version_of("triton"), "flash_attn": version_of("flash_attn"),
            "transformers": version_of("transformers"), "content_sha256": content_digest(checked_files())}


def env_with_threads(threads: int | None) -> dict[str, str]:
    """This process's environment, with `threads` CPU threads per child (OMP_NUM_THREADS) when given."""
    env = os.environ.copy()
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def _pytest(args: list[str], timeout: float, log, threads: int | None = None) -> dict:
    """One pytest run: counts and failing test names from its JUnit report; SIGINT at the time limit.

    `threads`: CPU threads per test process (OMP_NUM_THREADS), so that parallel workers do not oversubscribe."""
    report = ROOT / f".gpu_check_junit_{os.getpid()}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=25", "-rfE",
           "--tb=short", f"--junitxml={report}", *args]
    log.write(f"$ {' '.join(cmd[1:])}\n")
    log.flush()
    start = log.tell()
    env = env_with_threads(threads)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        proc.wait(timeout=max(1.0, timeout))
        timed_out = False
    except subprocess.TimeoutExpired:  # pytest writes its report and summary on an interrupt
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        timed_out = True
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            if case.find("failure") is not None or case.find("error") is not None:
                counts["failed"] += 1
                failures.append(name)
            elif case.find("skipped") is not None:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
        report.unlink()
    # pytest's own summary line wins: an interrupted run's report also lists the tests it cut short
    log.flush()
    with open(log.name, encoding="utf-8", errors="replace") as f:
        f.seek(start)
        summary = [line for line in f.read().splitlines() if re.search(r"\d+ (passed|failed)", line)]
    if summary:
        for key in counts:
            found = re.search(rf"(\d+) {key}", summary[-1])
            counts[key] = int(found.group(1)) if found else 0
        errors = re.search(r"(\d+) errors?", summary[-1])
        counts["failed"] += int(errors.group(1)) if errors else 0
    return {**counts, "timed_out": timed_out, "failures": failures}


# The tests/test_gpu*.py files marked `gpu` as a whole run alone, not under xdist: their engines size themselves from
# the free GPU memory, and twelve processes at once starve each other (test_gpu_tp2.py needs two GPUs, else skips).
GPU_TESTS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_gpu*.py")
                   if re.search(r"^pytestmark = \[?\s*pytest\.mark\.gpu", p.read_text(), re.M))


def run_tests(timeout: float, extra: list[str], workers: int, log_path: Path, dist: str = "loadfile",
              gpu_tests: str = "with", gpu_timeout: float | None = None) -> dict:
    """Every test file with CUDA visible: the GPU tests alone (they size engines from free memory), the rest
    spread over `workers` processes (by file, or by test with dist="load") when pytest-xdist is installed;
    counts summed."""
    ignored = {path: f"needs {module}" for path, module in NEEDS.items() if importlib.util.find_spec(module) is None}
    rest = [f"--ignore={path}" for path in ignored] + [f"--ignore={path}" for path in GPU_TESTS]
    threads = None
    if workers > 1 and importlib.util.find_spec("xdist") is not None:
        rest += ["-n", str(workers), "--dist", dist]
        threads = max(1, (os.cpu_count() or 2) // workers)  # 16 workers of 16 threads each on 16 cores crawl
    t0 = time.perf_counter()
    none = {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "timed_out": False}
    with open(log_path, "w") as log:
        gpu = _pytest([*GPU_TESTS, *extra], gpu_timeout or timeout / 2, log) if gpu_tests != "none" else none
        other = _pytest(["tests", *rest, *extra], timeout - (time.perf_counter() - t0), log, threads) \
            if gpu_tests != "only" else none
    print(log_path.read_text()[-6000:])
    return {key: gpu[key] + other[key] for key in ("passed", "failed", "skipped", "failures")} | {
        "timed_out": gpu["timed_out"] or other["timed_out"], "seconds": round(time.perf_counter() - t0, 1),
        "not_run": ignored, "workers": workers, "dist": dist, "gpu_tests": gpu_tests, "log": str(log_path)}


# The serve part. Its sweep is serve_load.py's, run as a child process (killed with its server at --serve-timeout).
SERVE_LOAD = ROOT / "benchmarks" / "serve_load.py"
SERVE_REFERENCE = ROOT / "benchmarks" / "serve_h200.json"
# requests/s: a light load, and one the committed sweep completed more slowly than offered, still below its saturation
SERVE_RATES = (16.0, 64.0)
SERVE_SECONDS = 4.0  # arrivals per rate: 64 and 256 requests, so the part takes about a minute
# How many times the committed ITL p50 or TTFT p50 a rate's fresh figure may be before the part fails. Runs vary:
# serve_load.py seeds each rate's Poisson arrivals by its place in the sweep, so this short sweep draws other
# arrivals than the committed one at the same rate; its window is shorter; and the committed points are one run on
# one machine, whose host (CPU, installed server stack) another machine with the same GPU does not share. A
# regression like the one issue 42 was opened for (ITL p50 at 32 requests/s more than threefold, serve_h200.json's
# regression_bisect) stays well outside it.
SERVE_TOLERANCE = 1.5
SERVE_METRICS = (("itl_p50", "ITL p50"), ("ttft_p50", "TTFT p50"))


def compare_serve(points: list[dict], reference: dict, rates: list[float], tolerance: float = SERVE_TOLERANCE
                  ) -> list[str]:
    """What is wrong with a sweep's `points` against the committed sweep `reference` (serve_h200.json's content), one
    message per rate and metric: a median more than `tolerance` times the committed one, a median missing, a failed
    request at a rate at or below the committed saturation rate (every rate, when the committed sweep never
    saturated), a rate not measured or not in the reference. Empty: the sweep passes."""
    committed = {float(p["rate"]): p for p in reference["points"]}
    measured = {float(p["rate"]): p for p in points}
    saturation = reference.get("saturation_rate")
    problems = []
    for rate in rates:
        ref, point = committed.get(float(rate)), measured.get(float(rate))
        if ref is None:
            problems.append(f"rate {rate:g}/s: the committed sweep has no point at this rate to compare with")
            continue
        if point is None:
            problems.append(f"rate {rate:g}/s: not measured (the sweep stopped before it)")
            continue
        for key, name in SERVE_METRICS:
            if point.get(key) is None:
                problems.append(f"rate {rate:g}/s: {name} missing (no request completed)")
            elif point[key] > tolerance * ref[key]:
                problems.append(f"rate {rate:g}/s: {name} {point[key] * 1e3:.2f} ms is {point[key] / ref[key]:.2f}x "
                                f"the committed {ref[key] * 1e3:.2f} ms (tolerance {tolerance:g}x)")
        if point.get("num_failed") and (saturation is None or rate <= saturation):
            why = ", ".join(f"{n} {reason}" for reason, n in point.get("failures", {}).items())
            problems.append(f"rate {rate:g}/s: {point['num_failed']} of {point['num_requests']} requests failed"
                            f"{f' ({why})' if why else ''}, at or below the committed saturation rate "
                            f"{'(none)' if saturation is None else f'{saturation:g}/s'}")
    return problems


def serve_reference(data: dict, gpu: str) -> tuple[str | None, dict]:
    """The committed sweep a fresh one on `gpu` is compared with: of serve_h200.json's whole sweeps (its top level,
    and each top-level entry that serve_load.py wrote whole: points, workload and provenance), the newest measured on
    a GPU of that name, by its provenance's date; the top level where none was. Returns (entry name or None for the
    top level, the sweep)."""
    sweeps = [(None, data)] + [(name, entry) for name, entry in data.items() if isinstance(entry, dict)
                               and {"points", "workload", "provenance"} <= entry.keys()]
    same = [(name, sweep) for name, sweep in sweeps if sweep["provenance"].get("gpu") == gpu]
    return max(same, key=lambda item: item[1]["provenance"].get("date", "")) if same else (None, data)


def client_workers_args(reference: dict, extra: list[str]) -> list[str]:
    """`--client-workers N` as the reference sweep's client ran (section 15.3 §4: one busy client process times
    itself), unless the caller's own serve_load.py flags say how many."""
    workers = reference["workload"].get("client_processes", 1)
    given = any(arg == "--client-workers" or arg.startswith("--client-workers=") for arg in extra)
    return [] if workers == 1 or given else ["--client-workers", str(workers)]


def client_warnings(points: list[dict]) -> list[str]:
    """One line per rate whose busiest client process was past CLIENT_BUSY_LIMIT (section 15.3 §4): there, the
    sweep's latencies are partly the client's own, and a pass or a failure says less about the server."""
    from nanoengine.serving.load import CLIENT_BUSY_LIMIT
    return [f"rate {p['rate']:g}/s: the busiest client process was {p['client_busy']:.0%} busy, past "
            f"CLIENT_BUSY_LIMIT ({CLIENT_BUSY_LIMIT:.0%}): its latencies are partly the client's own"
            for p in points if (p.get("client_busy") or 0.0) > CLIENT_BUSY_LIMIT]


def serve_sweep(rates: list[float], seconds: float, out: Path, timeout: float, extra: list[str] = (),
                log_path: Path | None = None) -> dict:
    """benchmarks/serve_load.py at `rates` for `seconds` of arrivals each, serve_h200.json's workload (prompt and
    output lengths), `extra` flags after those; its JSON (written to `out`, the server's log beside it). The sweep and
    its server run in a process group of their own, killed at `timeout` seconds: RuntimeError then, or when the
    sweep exits without its JSON."""
    workload = json.loads(SERVE_REFERENCE.read_text())["workload"]
    cmd = [sys.executable, str(SERVE_LOAD), str(out), "--rates", ",".join(f"{r:g}" for r in rates),
           "--seconds", f"{seconds:g}", "--prompt-len", str(workload["prompt_len"]),
           "--max-tokens", str(workload["max_tokens"]), *extra]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    log_path = log_path or out.with_suffix(".log")
    with open(log_path, "w") as log:
        log.write(f"$ {' '.join(cmd[1:])}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # serve_load.py and its server (and the server's engine process)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise RuntimeError(f"the sweep did not finish within {timeout:.0f} s (log: {log_path})") from None
    if proc.returncode != 0 or not out.exists():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        raise RuntimeError(f"the sweep exited with code {proc.returncode}: {tail[0][:300]} (log: {log_path})")
    return json.loads(out.read_text())


def run_serve(rates: list[float], seconds: float, tolerance: float, timeout: float, out: Path,
              extra: list[str] = ()) -> dict:
    """The serve part: a short sweep on the GPU, compared with serve_h200.json rate by rate."""
    import torch
    if not torch.cuda.is_available():
        return {"rates": list(rates), "seconds_per_rate": seconds, "tolerance": tolerance, "ok": False,
                "error": "no CUDA GPU: the serve part compares with a GPU's committed sweep"}
    entry, reference = serve_reference(json.loads(SERVE_REFERENCE.read_text()), torch.cuda.get_device_name())
    extra = [*extra, *client_workers_args(reference, list(extra))]
    section = {"rates": list(rates), "seconds_per_rate": seconds, "tolerance": tolerance,
               "reference": {"file": SERVE_REFERENCE.relative_to(ROOT).as_posix(), "entry": entry,
                             "gpu": reference["provenance"].get("gpu"),
                             "commit": reference["provenance"].get("commit"),
                             "saturation_rate": reference.get("saturation_rate")},
               "workload": {k: reference["workload"][k] for k in ("prompt_len", "max_tokens")},
               "sweep": str(out), "log": str(out.with_suffix(".log")),
               "server_log": str(out.with_suffix(".server.log"))}
    if extra:
        section["serve_load_args"] = list(extra)
    t0 = time.perf_counter()
    try:
        sweep = serve_sweep(rates, seconds, out, timeout, extra)
    except RuntimeError as e:
        return section | {"ok": False, "seconds": round(time.perf_counter() - t0, 1), "error": str(e)}
    committed = {float(p["rate"]): p for p in reference["points"]}
    points = []
    for p in sweep["points"]:
        ref = committed.get(float(p["rate"]), {})
        points.append({k: p.get(k) for k in ("rate", "num_requests", "num_failed", "failures", "achieved_rate",
                                             "output_tokens_per_s", "ttft_p50", "ttft_p90", "itl_p50", "itl_p90",
                                             "client_busy")}
                      | {f"committed_{key}": ref.get(key) for key, _ in SERVE_METRICS})
    problems = compare_serve(sweep["points"], reference, rates, tolerance)
    return section | {"ok": not problems, "seconds": round(time.perf_counter() - t0, 1), "points": points,
                      "problems": problems, "client_warnings": client_warnings(sweep["points"])}


def merge(paths: list[Path], out: Path, match_commit: str | None = None) -> dict:
    """One summary from parts run apart (on different GPUs of one machine, or in two calls) at one commit."""
    parts = [json.loads(path.read_text()) for path in paths]
    commits = sorted({part["provenance"]["commit"] for part in parts})
    for other in commits[1:]:  # parts of several commits: only where they differ in tests/ alone
        diff = subprocess.run(["git", "diff", "--name-only", commits[0], other], capture_output=True, text=True,
                              cwd=ROOT)
        changed = diff.stdout.split()
        if diff.returncode != 0 or any(not path.startswith("tests/") for path in changed):
            raise SystemExit(f"the parts are of commits {commits}, which differ beyond tests/: {changed or diff.stderr}")
    summary = {"provenance": parts[0]["provenance"], "parts": [str(path) for path in paths],
               "part_commits": [part["provenance"]["commit"] for part in parts]}
    if match_commit:  # every part must have run exactly this commit's files
        want = content_digest(commit_files(match_commit))
        ran = [part["provenance"].get("content_sha256") for part in parts]
        if any(digest != want for digest in ran):
            raise SystemExit(f"not every part ran {match_commit}'s files: content_sha256 {ran}, "
                             f"the commit's {want}")
        full = subprocess.run(["git", "rev-parse", match_commit], capture_output=True, text=True, cwd=ROOT,
                              check=True).stdout.strip()
        summary["provenance"] = {**summary["provenance"], "commit": full,
                                 "commit_note": "content_sha256 equals this commit's (scripts/gpu_check.py --merge)"}
    notebooks: dict[str, dict] = {}
    reruns = []  # a notebook run again in a later part: the later run counts, the earlier is kept here
    for part in parts:
        for r in part.get("notebooks", []):
            if r["name"] in notebooks:
                reruns.append({"name": r["name"], "earlier": notebooks[r["name"]], "later": r})
            notebooks[r["name"]] = r
    if reruns:
        summary["notebook_reruns"] = reruns
    if notebooks:
        summary["notebooks"] = [notebooks[name] for name in sorted(notebooks)]
    serves = [part["serve"] for part in parts if "serve" in part]
    if serves:  # the serve part run again in a later part: the later run counts, the earlier ones are kept
        summary["serve"] = serves[-1]
        if len(serves) > 1:
            summary["serve_reruns"] = serves[:-1]
    tests = [part["tests"] for part in parts if "tests" in part]
    if tests:
        summary["tests"] = {key: sum(t[key] for t in tests) for key in ("passed", "failed", "skipped", "seconds")}
        summary["tests"] |= {"failures": [f for t in tests for f in t["failures"]],
                             "timed_out": any(t["timed_out"] for t in tests),
                             "not_run": {k: v for t in tests for k, v in t.get("not_run", {}).items()},
                             "runs": [{k: t.get(k) for k in ("gpu_tests", "workers", "dist", "passed", "failed",
                                                           "skipped", "seconds")} for t in tests]}
    write_summary(summary, out)
    return summary


def run_notebook(path: Path, timeout: float, executed: Path | None) -> dict:
    """Execute one notebook top to bottom in a fresh kernel, every cell; {name, ok, seconds, error}."""
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    error = None
    try:
        client.execute()
    except Exception as e:  # a failing cell, a timeout or a dead kernel: recorded, and the next notebook runs
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:500]
    seconds = round(time.perf_counter() - t0, 1)
    if executed is not None:
        executed.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, executed / path.name)
    return {"name": path.stem, "ok": error is None, "seconds": seconds, **({"error": error} if error else {})}


def longest_first(paths: list[Path], record: Path) -> list[Path]:
    """The notebooks ordered by their time in an earlier check (`record`), longest first, unknown ones first of all:
    with several at once, the long ones no longer start last and finish past the deadline."""
    try:
        seconds = {r["name"]: r["seconds"] for r in json.loads(record.read_text()).get("notebooks", [])}
    except (OSError, ValueError, KeyError, TypeError):
        seconds = {}
    return sorted(paths, key=lambda p: (-seconds.get(p.stem, float("inf")), p.name))


def run_notebook_isolated(path: Path, cell_timeout: float, limit: float, executed: Path | None,
                          threads: int | None = None) -> dict:
    """run_notebook in its own process group, killed with its kernel when `limit` seconds pass.

    `threads`: CPU threads for the kernel (OMP_NUM_THREADS), so that notebooks run at once do not oversubscribe."""
    cmd = [sys.executable, __file__, "--one", str(path), "--cell-timeout", str(cell_timeout)]
    if executed is not None:
        cmd += ["--executed", str(executed)]
    env = env_with_threads(threads)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True, env=env)
    try:
        out, _ = proc.communicate(timeout=max(1.0, limit))
        result = json.loads(out.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the kernel is in the same group
        proc.wait()
        result = {"name": path.stem, "ok": False, "error": f"not finished within {limit:.0f} s"}
    except (json.JSONDecodeError, IndexError):
        result = {"name": path.stem, "ok": False, "error": f"the runner exited with code {proc.returncode}"}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"{'ok  ' if result['ok'] else 'FAIL'} {result['seconds']:7.1f} s  {path.name}"
          + (f"  {result['error']}" if not result["ok"] else ""), flush=True)
    return result


def write_summary(summary: dict, out: Path) -> None:
    """Write the summary, with `ok` true only when every notebook ran, every test passed and the serve part passed."""
    notebooks, tests = summary.get("notebooks", []), summary.get("tests", {})
    summary["ok"] = bool(notebooks) and all(r["ok"] for r in notebooks) and bool(tests) \
        and tests["failed"] == 0 and not tests["timed_out"] and summary.get("serve", {}).get("ok", False)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["all", "tests", "notebooks", "serve"], default="all")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "gpu_check.json")
    parser.add_argument("--executed", type=Path, default=None, help="keep the executed notebooks here")
    parser.add_argument("--notebooks", nargs="*", default=None, help="names (stems) to run; default: all")
    parser.add_argument("--cell-timeout", type=float, default=600, help="seconds per cell")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks executed at once")
    parser.add_argument("--alone", nargs="*", default=["13_benchmarks"],
                        help="notebooks run before the others, by themselves (they size engines from free memory)")
    parser.add_argument("--tests-timeout", type=float, default=1200, help="seconds for the whole pytest run")
    parser.add_argument("--gpu-tests-timeout", type=float, default=None,
                        help="seconds for the GPU tests (default: half of --tests-timeout); on two H200s they took "
                             "about 5 minutes")
    parser.add_argument("--workers", type=int, default=min(8, (os.cpu_count() or 2) // 2),
                        help="pytest-xdist processes for the tests other than tests/test_gpu.py")
    parser.add_argument("--dist", default="loadfile", choices=["loadfile", "load"],
                        help="how pytest-xdist spreads the tests: by file, or test by test (better with many workers)")
    parser.add_argument("--gpu-tests", default="with", choices=["with", "only", "none"],
                        help="the GPU tests (run first, alone) with the others, only them, or none of them")
    parser.add_argument("--merge", nargs="+", type=Path, default=None,
                        help="combine summaries written apart (same commit) into --out, and run nothing")
    parser.add_argument("--commit", default=None,
                        help="--merge: the commit the parts ran, checked by the files' content_sha256 (a copy of the "
                             "repository may report another commit to git)")
    parser.add_argument("--tests-log", type=Path, default=ROOT / "_build" / "gpu_check_tests.log")
    parser.add_argument("--deadline", type=float, default=3600,
                        help="seconds for the notebooks part; notebooks not done by then are recorded as failed")
    parser.add_argument("--serve-rates", default=",".join(f"{r:g}" for r in SERVE_RATES),
                        help="the serve part's offered rates (requests/s, comma-separated); each must be a rate of "
                             "serve_h200.json's points")
    parser.add_argument("--serve-seconds", type=float, default=SERVE_SECONDS, help="seconds of arrivals per rate")
    parser.add_argument("--serve-tolerance", type=float, default=SERVE_TOLERANCE,
                        help="fail when ITL p50 or TTFT p50 is more than this many times the committed figure")
    parser.add_argument("--serve-timeout", type=float, default=600,
                        help="seconds for the serve part, the server's start included")
    parser.add_argument("--serve-out", type=Path, default=ROOT / "_build" / "gpu_check_serve.json",
                        help="serve_load.py's JSON (its log and the server's log beside it)")
    parser.add_argument("--serve-load-args", default="",
                        help="more flags for benchmarks/serve_load.py, e.g. \"--server-args='--max-model-len 4096'\"")
    parser.add_argument("--one", type=Path, default=None, help=argparse.SUPPRESS)  # a child: one notebook
    parser.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args(argv)
    if args.merge:
        summary = merge(args.merge, args.out, args.commit)
        print(f"merged {len(args.merge)} parts: {'OK' if summary['ok'] else 'NOT OK'} -> {args.out}")
        return summary
    if args.one is not None:
        print(json.dumps(run_notebook(args.one, args.cell_timeout, args.executed)), flush=True)
        return {"ok": True}
    if args.part == "serve":
        import torch
        if not torch.cuda.is_available():
            raise SystemExit("--part serve needs a CUDA GPU: it compares a sweep with a GPU's committed figures "
                             "in benchmarks/serve_h200.json (nothing was run or written)")
    summary = {"provenance": provenance()}
    if args.out.exists():
        previous = json.loads(args.out.read_text())
        if previous.get("provenance", {}).get("commit") == summary["provenance"]["commit"]:
            summary = {**previous, "provenance": {**previous["provenance"], **summary["provenance"]}}
    if args.part in ("all", "serve"):  # first, on a GPU nothing else has used yet
        rates = [float(r) for r in args.serve_rates.split(",")]
        summary["serve"] = run_serve(rates, args.serve_seconds, args.serve_tolerance, args.serve_timeout,
                                     args.serve_out, shlex.split(args.serve_load_args))
        serve = summary["serve"]
        print(f"serve: {'ok' if serve['ok'] else 'FAIL'}"
              + "".join(f"\n  {line}" for line in serve.get("problems", []) + [serve.get("error", "")] if line),
              flush=True)
        write_summary(summary, args.out)
    if args.part in ("all", "tests"):
        args.tests_log.parent.mkdir(parents=True, exist_ok=True)
        summary["tests"] = run_tests(args.tests_timeout, args.pytest_args, args.workers, args.tests_log,
                                     args.dist, args.gpu_tests, args.gpu_tests_timeout)
    if args.part in ("all", "notebooks"):
        paths = sorted(NOTEBOOKS.glob("*.ipynb"))
        if args.notebooks:
            paths = [p for p in paths if p.stem in set(args.notebooks)]
        done = {r["name"]: r for r in summary.get("notebooks", [])}
        end = time.perf_counter() + args.deadline

        def record(result: dict) -> None:
            done[result["name"]] = result
            summary["notebooks"] = [done[name] for name in sorted(done)]
            write_summary(summary, args.out)  # after every notebook: a killed run keeps what it did

        threads = max(1, (os.cpu_count() or 1) // max(1, args.jobs)) if args.jobs > 1 else None

        def run(path: Path, threads: int | None = threads) -> dict:
            return run_notebook_isolated(path, args.cell_timeout, end - time.perf_counter(), args.executed, threads)

        alone = [p for p in paths if p.stem in set(args.alone)]
        for path in alone:
            record(run(path, None))
        rest = longest_first([p for p in paths if p not in alone], ROOT / "benchmarks" / "gpu_check.json")
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for result in pool.map(run, rest):
                record(result)
    write_summary(summary, args.out)
    notebooks, tests = summary.get("notebooks", []), summary.get("tests", {})
    serve = "not run" if "serve" not in summary else "ok" if summary["serve"]["ok"] else "FAIL"
    print(f"notebooks: {sum(r['ok'] for r in notebooks)} of {len(notebooks)} ran; tests: "
          f"{tests.get('passed', 0)} passed, {tests.get('failed', 0)} failed, {tests.get('skipped', 0)} skipped; "
          f"serve: {serve}; "
          f"{'OK' if summary['ok'] else 'NOT OK'} -> {args.out}")
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
