"""scripts/gpu_check.py's bookkeeping, on the CPU: merging parts, and naming the commit whose files ran."""

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
    """A tests part and a notebooks part, as two device calls write them."""
    prov = {"commit": label, "content_sha256": digest, "gpu": "test"}
    tests = {"passed": 3, "failed": 0, "skipped": 1, "seconds": 2.0, "failures": [], "timed_out": False,
             "not_run": {"tests/test_book.py": "needs jupyter_book"}}
    parts = [{"provenance": prov, "tests": tests},
             {"provenance": prov, "notebooks": [{"name": "00_orientation", "ok": True, "seconds": 1.0}]}]
    paths = [tmp_path / f"part{i}.json" for i in range(2)]
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
    again = tmp_path / "part2.json"
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
