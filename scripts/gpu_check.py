"""The GPU check: the whole test suite with CUDA visible, then every notebook executed top to bottom, all cells.

Run it on a machine with a CUDA GPU (and flash-attn, to cover the FlashAttention paths):

    python scripts/gpu_check.py                      # both parts, writes benchmarks/gpu_check.json
    python scripts/gpu_check.py --part tests         # one part; the other part's results are kept when the
    python scripts/gpu_check.py --part notebooks     #   summary on disk is of the same commit

nbval skips the `# NBVAL_SKIP` cells that hold the GPU paths, so the notebooks run through nbclient here, every
cell included, each notebook in a fresh kernel with a time limit. `--executed DIR` keeps the executed notebooks;
`scripts/keep_gpu_outputs.py DIR` then copies the GPU cells' outputs into notebooks/ for the site.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
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
            "transformers": version_of("transformers")}


def run_tests(timeout: float, extra: list[str]) -> dict:
    """pytest over tests/ with CUDA visible; counts from its JUnit report."""
    report = ROOT / ".gpu_check_junit.xml"
    ignored = {path: f"needs {module}" for path, module in NEEDS.items() if importlib.util.find_spec(module) is None}
    cmd = [sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
           *[f"--ignore={path}" for path in ignored], *extra]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, timeout=timeout, capture_output=True, text=True)
        tail, timed_out = (proc.stdout + proc.stderr)[-4000:], False
    except subprocess.TimeoutExpired as e:
        tail, timed_out = str(e.stdout or "")[-4000:], True
    seconds = round(time.perf_counter() - t0, 1)
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
    print(tail)
    return {**counts, "seconds": seconds, "timed_out": timed_out, "failures": failures,
            "not_run": ignored, "command": " ".join(cmd[1:])}


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
    print(f"{'ok  ' if error is None else 'FAIL'} {seconds:7.1f} s  {path.name}" + (f"  {error}" if error else ""),
          flush=True)
    return {"name": path.stem, "ok": error is None, "seconds": seconds, **({"error": error} if error else {})}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["all", "tests", "notebooks"], default="all")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "gpu_check.json")
    parser.add_argument("--executed", type=Path, default=None, help="keep the executed notebooks here")
    parser.add_argument("--notebooks", nargs="*", default=None, help="names (stems) to run; default: all")
    parser.add_argument("--cell-timeout", type=float, default=600, help="seconds per cell")
    parser.add_argument("--tests-timeout", type=float, default=1200, help="seconds for the whole pytest run")
    parser.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args(argv)
    summary = {"provenance": provenance()}
    if args.out.exists():
        previous = json.loads(args.out.read_text())
        if previous.get("provenance", {}).get("commit") == summary["provenance"]["commit"]:
            summary = {**previous, "provenance": {**previous["provenance"], **summary["provenance"]}}
    if args.part in ("all", "tests"):
        summary["tests"] = run_tests(args.tests_timeout, args.pytest_args)
    if args.part in ("all", "notebooks"):
        paths = sorted(NOTEBOOKS.glob("*.ipynb"))
        if args.notebooks:
            paths = [p for p in paths if p.stem in set(args.notebooks)]
        done = {r["name"]: r for r in summary.get("notebooks", [])}
        for path in paths:
            done[path.stem] = run_notebook(path, args.cell_timeout, args.executed)
        summary["notebooks"] = [done[name] for name in sorted(done)]
    notebooks = summary.get("notebooks", [])
    tests = summary.get("tests", {})
    summary["ok"] = bool(notebooks) and all(r["ok"] for r in notebooks) and bool(tests) \
        and tests["failed"] == 0 and not tests["timed_out"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"notebooks: {sum(r['ok'] for r in notebooks)} of {len(notebooks)} ran; tests: "
          f"{tests.get('passed', 0)} passed, {tests.get('failed', 0)} failed, {tests.get('skipped', 0)} skipped; "
          f"{'OK' if summary['ok'] else 'NOT OK'} -> {args.out}")
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
