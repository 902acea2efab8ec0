"""scripts/gpu_check.py's bookkeeping, on the CPU: merging parts, naming the commit whose files ran, and judging the
serve part's sweep against the committed one."""

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def write_parts(tmp_path: Path, digest: str, label: str) -> list[Path]:
    """A tests part, a notebooks part and a serve part, as three device calls write them."""
    prov = {"commit": label, "content_sha256": digest, "gpu": "test"}
    tests = {"passed": 3, "failed": 0, "skipped": 1, "seconds": 2.0, "failures": [], "timed_out": False,
             "not_run": {"tests/test_book.py": "needs jupyter_book"}}
    parts = [{"provenance": prov, "tests": tests},
             {"provenance": prov, "notebooks": [{"name": "00_orientation", "ok": True, "seconds": 1.0}]},
             {"provenance": prov, "serve": {"ok": True, "rates": [16.0, 64.0], "problems": []}}]
    paths = [tmp_path / f"part{i}.json" for i in range(3)]
    for path, part in zip(paths, parts):
        path.write_text(json.dumps(part))
    return paths


def test_the_digest_depends_on_every_path_and_byte():
    base = gpu_check.content_digest({"a.py": b"x", "b.py": b"y"})
    assert base == gpu_check.content_digest({"b.py": b"y", "a.py": b"x"})
    assert base != gpu_check.content_digest({"a.py": b"x", "b.py": b"z"})
    assert base != gpu_check.content_digest({"a.py": b"x", "c.py": b"y"})


def test_merge_names_the_commit_whose_files_ran_and_refuses_another(tmp_path):
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                          check=True).stdout.strip()
    digest = gpu_check.content_digest(gpu_check.commit_files("HEAD"))
    paths = write_parts(tmp_path, digest, label="a-stale-base-commit")
    summary = gpu_check.merge(paths, tmp_path / "out.json", match_commit="HEAD")
    assert summary["provenance"]["commit"] == head and summary["ok"]
    assert summary["tests"]["not_run"] == {"tests/test_book.py": "needs jupyter_book"}
    other = write_parts(tmp_path, "0" * 64, label=head)
    with pytest.raises(SystemExit, match="not every part ran"):
        gpu_check.merge(other, tmp_path / "out2.json", match_commit="HEAD")


def test_merge_counts_a_notebook_run_again_and_keeps_the_earlier_run(tmp_path):
    digest = gpu_check.content_digest(gpu_check.commit_files("HEAD"))
    paths = write_parts(tmp_path, digest, label="HEAD")
    first = json.loads(paths[1].read_text())
    first["notebooks"].append({"name": "03_scheduler", "ok": False, "seconds": 390.0, "error": "not finished"})
    paths[1].write_text(json.dumps(first))
    again = tmp_path / "part3.json"
    again.write_text(json.dumps({"provenance": first["provenance"],
                                 "notebooks": [{"name": "03_scheduler", "ok": True, "seconds": 23.8}]}))
    summary = gpu_check.merge([*paths, again], tmp_path / "out.json", match_commit="HEAD")
    assert summary["ok"] and [n["name"] for n in summary["notebooks"]] == ["00_orientation", "03_scheduler"]
    assert summary["notebook_reruns"] == [{"name": "03_scheduler", "earlier": first["notebooks"][1],
                                           "later": {"name": "03_scheduler", "ok": True, "seconds": 23.8}}]


def test_notebooks_start_longest_first_and_unknown_ones_before_all(tmp_path):
    record = tmp_path / "check.json"
    record.write_text(json.dumps({"notebooks": [{"name": "a", "seconds": 5.0}, {"name": "b", "seconds": 90.0},
                                                {"name": "c", "seconds": 30.0}]}))
    paths = [Path(f"{name}.ipynb") for name in ("a", "b", "c", "new")]
    assert [p.stem for p in gpu_check.longest_first(paths, record)] == ["new", "b", "c", "a"]
    assert [p.stem for p in gpu_check.longest_first(paths, tmp_path / "missing.json")] == ["a", "b", "c", "new"]


# The committed sweep as compare_serve reads it: points by rate, and the saturation rate.
REFERENCE = {"saturation_rate": 128.0, "points": [
    {"rate": 16.0, "num_requests": 80, "num_failed": 0, "failures": {}, "ttft_p50": 0.030, "itl_p50": 0.0020},
    {"rate": 64.0, "num_requests": 320, "num_failed": 0, "failures": {}, "ttft_p50": 0.074, "itl_p50": 0.0040},
    {"rate": 128.0, "num_requests": 640, "num_failed": 4, "failures": {"ReadError": 4}, "ttft_p50": 0.28,
     "itl_p50": 0.0072}]}


def point(rate: float, ttft: float | None, itl: float | None, failed: int = 0, **failures: int) -> dict:
    return {"rate": rate, "num_requests": 64, "num_failed": failed, "failures": failures, "ttft_p50": ttft,
            "itl_p50": itl}


def test_a_sweep_within_the_tolerance_passes():
    tolerance = gpu_check.SERVE_TOLERANCE
    points = [point(16.0, 0.030 * tolerance * 0.99, 0.0020 * tolerance * 0.99), point(64.0, 0.05, 0.0030)]
    assert gpu_check.compare_serve(points, REFERENCE, [16.0, 64.0]) == []


def test_a_median_beyond_the_tolerance_fails_naming_the_rate_and_the_metric():
    points = [point(16.0, 0.030, 0.0020), point(64.0, 0.074, 0.0040 * 2)]
    problems = gpu_check.compare_serve(points, REFERENCE, [16.0, 64.0], tolerance=1.5)
    assert len(problems) == 1 and problems[0].startswith("rate 64/s: ITL p50 8.00 ms is 2.00x the committed 4.00 ms")
    points = [point(16.0, 0.030 * 1.6, 0.0020), point(64.0, 0.074, 0.0040)]
    problems = gpu_check.compare_serve(points, REFERENCE, [16.0, 64.0], tolerance=1.5)
    assert len(problems) == 1 and problems[0].startswith("rate 16/s: TTFT p50 48.00 ms is 1.60x")
    assert gpu_check.compare_serve(points, REFERENCE, [16.0, 64.0], tolerance=2.0) == []


def test_failed_requests_fail_at_or_below_the_committed_saturation_rate_only():
    points = [point(16.0, 0.030, 0.0020, 2, ReadError=2), point(128.0, 0.28, 0.0072, 3, ReadError=3)]
    problems = gpu_check.compare_serve(points, REFERENCE, [16.0, 128.0])
    assert problems == ["rate 16/s: 2 of 64 requests failed (2 ReadError), at or below the committed saturation "
                        "rate 128/s", "rate 128/s: 3 of 64 requests failed (3 ReadError), at or below the committed "
                        "saturation rate 128/s"]
    past = {**REFERENCE, "saturation_rate": 64.0}  # past the committed saturation, failures do not count
    assert gpu_check.compare_serve(points[1:], past, [128.0]) == []


def test_a_rate_missing_from_either_sweep_or_with_no_request_completed_fails():
    problems = gpu_check.compare_serve([point(16.0, None, None, 64)], REFERENCE, [16.0, 64.0, 24.0])
    assert [p.split(":")[0] for p in problems] == ["rate 16/s"] * 3 + ["rate 64/s", "rate 24/s"]
    assert "TTFT p50 missing" in problems[1] and "not measured" in problems[3] and "no point" in problems[4]


def test_the_merged_summary_holds_the_serve_section_and_its_ok_counts(tmp_path):
    paths = write_parts(tmp_path, "0" * 64, label="one-commit")
    summary = gpu_check.merge(paths, tmp_path / "out.json")
    assert summary["ok"] and summary["serve"]["rates"] == [16.0, 64.0]
    assert json.loads((tmp_path / "out.json").read_text())["serve"] == summary["serve"]
    assert not gpu_check.merge(paths[:2], tmp_path / "out.json")["ok"]  # no serve part
    failed = tmp_path / "serve_failed.json"
    failed.write_text(json.dumps({**json.loads(paths[2].read_text()), "serve": {
        "ok": False, "problems": ["rate 64/s: ITL p50 8.00 ms is 2.00x the committed 4.00 ms (tolerance 1.5x)"]}}))
    summary = gpu_check.merge([*paths, failed], tmp_path / "out.json")
    assert not summary["ok"] and summary["serve"]["problems"][0].startswith("rate 64/s: ITL p50")
    assert summary["serve_reruns"] == [json.loads(paths[2].read_text())["serve"]]
    summary = gpu_check.merge([paths[0], paths[1], failed, paths[2]], tmp_path / "out.json")
    assert summary["ok"]  # the later run counts


def test_the_reference_is_the_newest_whole_sweep_on_the_same_gpu():
    def sweep(gpu: str, date: str, workers: int = 1) -> dict:
        return {"provenance": {"gpu": gpu, "date": date}, "workload": {"client_processes": workers},
                "points": REFERENCE["points"], "saturation_rate": 128.0}
    data = {**sweep("NVIDIA H200", "2026-12-04"), "h100_old": sweep("NVIDIA H100", "2026-12-05"),
            "h100_new": sweep("NVIDIA H100", "2026-12-06", workers=4),
            "h200_part": {"provenance": {"gpu": "NVIDIA H200", "date": "2026-12-07"}, "points": []},
            "note": "text"}
    assert gpu_check.serve_reference(data, "NVIDIA H100")[0] == "h100_new"
    name, reference = gpu_check.serve_reference(data, "NVIDIA H200")  # an entry without a workload: not whole
    assert name is None and reference is data
    assert gpu_check.serve_reference(data, "NVIDIA B200") == (None, data)  # no sweep of that GPU: the top level
    assert gpu_check.client_workers_args(data["h100_new"], []) == ["--client-workers", "4"]
    assert gpu_check.client_workers_args(data["h100_new"], ["--client-workers", "2"]) == []
    assert gpu_check.client_workers_args(data["h100_new"], ["--client-workers=2"]) == []
    assert gpu_check.client_workers_args(data, []) == []


def test_a_busy_client_is_named_with_its_rate():
    points = [point(16.0, 0.03, 0.002) | {"client_busy": 0.3}, point(64.0, 0.07, 0.004) | {"client_busy": 0.91},
              point(128.0, 0.2, 0.008)]  # a point from before client_busy was kept: no warning
    [warning] = gpu_check.client_warnings(points)
    assert warning.startswith("rate 64/s: the busiest client process was 91% busy")


def test_the_serve_sweep_runs_serve_load_on_the_cpu(tmp_path):
    """serve_sweep drives benchmarks/serve_load.py end to end: the tiny preset on the CPU, short prompts."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    from nanoengine.bench import ensure_checkpoint
    model = ensure_checkpoint("tiny", tmp_path / "tiny")
    sweep = gpu_check.serve_sweep([4.0], 1.0, tmp_path / "sweep.json", timeout=240, extra=[
        "--model", str(model), "--min-requests", "4", "--prompt-len", "16", "--max-tokens", "8",
        "--server-args=--device cpu --max-model-len 256"])
    [p] = sweep["points"]
    assert p["rate"] == 4.0 and p["num_failed"] == 0 and p["itl_p50"] > 0 and p["ttft_p50"] > 0
    assert 0 < p["client_busy"] < 1 and p["server_first_token"]["request_prefill_time_mean"] > 0
    assert (tmp_path / "sweep.log").read_text().startswith("$ ") and (tmp_path / "sweep.server.log").exists()


def test_the_serve_part_refuses_without_cuda(tmp_path, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "check.json"
    with pytest.raises(SystemExit, match="--part serve needs a CUDA GPU"):
        gpu_check.main(["--part", "serve", "--out", str(out)])
    assert not out.exists()
    section = gpu_check.run_serve([16.0], 1.0, 1.5, 10, tmp_path / "sweep.json")  # in --part all: recorded
    assert not section["ok"] and section["error"].startswith("no CUDA GPU")
