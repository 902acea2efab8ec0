"""Project-level contracts: packaging, the conda environment, CI, nbdev export and the saved notebooks."""

import copy
import filecmp
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
PROJECT = PYPROJECT["project"]
NAME = canonicalize_name(PROJECT["name"])
EXTRAS = PROJECT["optional-dependencies"]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
# The venv's console scripts sit next to its python; never pick up another install from PATH.
BIN = Path(sys.executable).parent
IGNORED_DIRS = ("__pycache__", ".ipynb_checkpoints")


def req_key(req: Requirement) -> str:
    """A canonical string for a requirement, so `a>=1,<2` and `a<2,>=1` compare equal."""
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    spec = ",".join(sorted(str(s) for s in req.specifier))
    marker = f"; {req.marker}" if req.marker else ""
    return f"{canonicalize_name(req.name)}{extras}{spec}{marker}"


def expand_extra(extra: str, seen: frozenset = frozenset()) -> set[str]:
    """The requirements of one extra of this project, with self-references like `nanoengine[book]` expanded."""
    if extra in seen:
        return set()
    out: set[str] = set()
    for line in EXTRAS[extra]:
        req = Requirement(line)
        if canonicalize_name(req.name) == NAME:
            for sub in req.extras:
                out |= expand_extra(sub, seen | {extra})
        else:
            out.add(req_key(req))
    return out


def names(keys: set[str]) -> set[str]:
    """Just the canonical package names of a set of `req_key`s."""
    return {re.split(r"[\[<>=!~;]", k, maxsplit=1)[0] for k in keys}


RUNTIME = {req_key(Requirement(r)) for r in PROJECT["dependencies"]}


# --- environment.yml mirrors `pip install -e .[dev]` -------------------------------------------------------------

def load_environment() -> tuple[list[str], list[str]]:
    """The conda dependencies (strings) and the pip requirements of environment.yml."""
    env = yaml.safe_load((REPO / "environment.yml").read_text(encoding="utf-8"))
    conda, pip = [], []
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            pip.extend(dep["pip"])
        else:
            conda.append(str(dep))
    return conda, pip


def test_environment_yml_pip_requirements_match_pyproject():
    _, pip = load_environment()
    reqs = [r for r in pip if not r.startswith("-e")]
    env_keys = {req_key(Requirement(r)) for r in reqs}
    assert len(env_keys) == len(reqs), f"duplicate pip requirements in environment.yml: {sorted(reqs)}"
    want = RUNTIME | expand_extra("dev")
    assert env_keys == want, (
        "environment.yml is out of sync with pyproject.toml (dependencies + the dev extra):\n"
        f"  missing from environment.yml: {sorted(want - env_keys)}\n"
        f"  extra in environment.yml:     {sorted(env_keys - want)}"
    )


def test_environment_yml_installs_the_package_with_python_and_pip():
    conda, pip = load_environment()
    assert "-e ." in [p.strip() for p in pip], "environment.yml must install the package itself with `-e .`"
    assert "pip" in conda, "environment.yml needs conda's `pip` to install the pip section"
    pythons = [c.replace(" ", "") for c in conda if re.match(r"python\b", c)]
    want = "python" + PROJECT["requires-python"].replace(" ", "")
    assert pythons == [want], f"environment.yml pins {pythons}, pyproject's requires-python gives {want!r}"


# --- the extras contract -------------------------------------------------------------------------------------------

def test_extras_are_exactly_gpu_book_serve_test_gguf_dev():
    assert set(EXTRAS) == {"gpu", "book", "serve", "test", "gguf", "dev"}


def test_extras_contents():
    gpu, book, test = expand_extra("gpu"), expand_extra("book"), expand_extra("test")
    assert "flash-attn" in names(gpu)
    assert {"jupyter-book<2,>=1", "ipywidgets", "matplotlib"} <= book, sorted(book)
    assert {"pytest", "nbval", "hypothesis"} <= names(test), sorted(test)
    serve = expand_extra("serve")
    assert {"fastapi", "uvicorn"} <= names(serve), sorted(serve)
    dev = expand_extra("dev")
    gguf = expand_extra("gguf")
    assert {"gguf", "accelerate"} <= names(gguf), sorted(gguf)
    assert book | serve | test | gguf <= dev, f"dev lacks {sorted((book | serve | test | gguf) - dev)}"
    assert "nbdev" in names(dev)
    # dev must install on a machine without CUDA: flash-attn only builds against a CUDA toolkit.
    assert "flash-attn" not in names(dev | RUNTIME), "flash-attn belongs in the gpu extra only"


# --- CI runs the README's test command, nothing else ---------------------------------------------------------------

def readme_test_command() -> str:
    """The `make test` line of the README's "Two commands" code block, without its comment."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = re.search(r"^##\s+Two commands\s*$(.*?)(?=^##\s|\Z)", text, re.M | re.S)
    assert section, "README.md has no '## Two commands' section"
    block = re.search(r"^```[^\n]*\n(.*?)^```", section.group(1), re.M | re.S)
    assert block, "the README's 'Two commands' section has no code block"
    lines = [ln.split("#", 1)[0].strip() for ln in block.group(1).splitlines() if "make test" in ln]
    assert len(lines) == 1, f"expected one `make test` line in the README's code block, got {lines}"
    return lines[0]


def test_ci_runs_the_readme_test_command_and_nothing_else():
    commands = []
    for line in (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#") or re.match(r"(set|cd)(\s|$)", line):
            continue
        commands.append(line)
    assert commands == [readme_test_command()], f".ci/run runs {commands}"


# --- nanoengine/ is exactly what nbdev exports from notebooks/ -----------------------------------------------------

def tree_files(root: Path) -> set[str]:
    """Relative paths of the files under `root`, skipping caches."""
    return {
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and not any(part in IGNORED_DIRS for part in p.relative_to(root).parts)
    }


def export_into(tmp: Path, with_package: bool) -> Path:
    """Run the venv's `nbdev-export` on a copy of the project in `tmp`; return the exported package folder."""
    ignore = shutil.ignore_patterns(*IGNORED_DIRS)
    shutil.copy2(REPO / "pyproject.toml", tmp / "pyproject.toml")
    shutil.copytree(REPO / "notebooks", tmp / "notebooks", ignore=ignore)
    if with_package:
        shutil.copytree(REPO / "nanoengine", tmp / "nanoengine", ignore=ignore)
    proc = subprocess.run([str(BIN / "nbdev-export")], cwd=tmp, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"nbdev-export failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return tmp / "nanoengine"


def compare_packages(exported: Path) -> list[str]:
    """Human-readable differences between an exported package and the repository's nanoengine/."""
    repo_pkg = REPO / "nanoengine"
    ours, theirs = tree_files(repo_pkg), tree_files(exported)
    diffs = [f"  added by nbdev-export:   nanoengine/{f}" for f in sorted(theirs - ours)]
    diffs += [f"  not produced by export:  nanoengine/{f}" for f in sorted(ours - theirs)]
    diffs += [
        f"  changed by nbdev-export: nanoengine/{f}"
        for f in sorted(ours & theirs)
        if not filecmp.cmp(repo_pkg / f, exported / f, shallow=False)
    ]
    return diffs


def test_nbdev_export_would_not_change_the_package(tmp_path):
    diffs = compare_packages(export_into(tmp_path, with_package=True))
    assert not diffs, "nanoengine/ is out of sync with notebooks/; run `make export` and commit:\n" + "\n".join(diffs)


def test_package_holds_no_module_that_no_notebook_exports(tmp_path):
    """A fresh export catches modules left behind by a renamed or deleted notebook (nbdev never deletes files)."""
    diffs = compare_packages(export_into(tmp_path, with_package=False))
    assert not diffs, (
        "a fresh `nbdev-export` into an empty nanoengine/ does not reproduce the committed package "
        "(delete stale modules, then `make export`):\n" + "\n".join(diffs)
    )


# --- the saved notebooks --------------------------------------------------------------------------------------------

def nbval_markers(cell: dict) -> list[str]:
    """The `# NBVAL_*` marker lines of a cell's source."""
    src = cell.get("source", "")
    src = "".join(src) if isinstance(src, list) else src
    return [ln.strip() for ln in src.splitlines() if ln.strip().startswith("# NBVAL_")]


def nbdev_clean(nb: dict) -> None:
    """Apply, in memory, what `nbdev-clean` does to a notebook, with this project's [tool.nbdev] settings."""
    from nbdev.clean import clean_nb
    from nbdev.config import get_config

    cfg = get_config(path=REPO)
    clean_nb(
        nb,
        clear_all=cfg.clear_all,
        allowed_metadata_keys=cfg.get("allowed_metadata_keys") or [],
        allowed_cell_metadata_keys=cfg.get("allowed_cell_metadata_keys") or [],
        clean_ids=cfg.clean_ids,
        allowed_out_metadata_keys=cfg.get("allowed_out_metadata_keys") or [],
    )


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no notebooks"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_cell_tags_and_nbval_markers_survive_nbdev_clean(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    cleaned = copy.deepcopy(nb)
    nbdev_clean(cleaned)
    assert len(cleaned["cells"]) == len(nb["cells"]), "nbdev-clean added or removed cells"
    lost = []
    for i, (before, after) in enumerate(zip(nb["cells"], cleaned["cells"])):
        tags_before = before.get("metadata", {}).get("tags")
        tags_after = after.get("metadata", {}).get("tags")
        if tags_before != tags_after:
            lost.append(f"cell {i}: tags {tags_before} -> {tags_after}")
        if nbval_markers(before) != nbval_markers(after):
            lost.append(f"cell {i}: NBVAL markers {nbval_markers(before)} -> {nbval_markers(after)}")
        kinds_before = [o.get("output_type") for o in before.get("outputs", [])]
        kinds_after = [o.get("output_type") for o in after.get("outputs", [])]
        if kinds_before != kinds_after:
            lost.append(f"cell {i}: outputs {kinds_before} -> {kinds_after}")
    assert not lost, (
        f"nbdev-clean would strip what Jupyter Book and nbval read from {path.name} "
        "(keep `tags` with allowed_cell_metadata_keys in [tool.nbdev]):\n  " + "\n  ".join(lost)
    )


def install_cell_index(cells: list[dict]) -> int:
    """Where the hosted-runtime install cell belongs: after `#| default_exp`, else first of the code."""
    first = next(i for i, c in enumerate(cells) if c["cell_type"] == "code")
    return first + 1 if "".join(cells[first]["source"]).startswith("#| default_exp") else first


def test_every_notebook_has_the_same_hidden_install_cell_before_its_code():
    """A notebook opened on a hosted runtime (Colab) installs nanoengine before its first import."""
    sources, problems = set(), []
    for path in NOTEBOOKS:
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        cell = cells[install_cell_index(cells)]
        source = "".join(cell["source"])
        if "NANOENGINE_SOURCE" not in source:
            problems.append(f"{path.name}: no install cell before the first code")
            continue
        if "remove-cell" not in cell.get("metadata", {}).get("tags", []):
            problems.append(f"{path.name}: the install cell is not tagged remove-cell")
        sources.add(source)
    assert not problems, "\n".join(problems)
    assert len(sources) == 1, "the notebooks' install cells differ; keep one text (CONTRIBUTING.md)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_saved_executed_without_errors(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    problems, counts = [], []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if src.strip():
            if cell.get("execution_count") is None:
                problems.append(f"cell {i} was not executed")
            else:
                counts.append(cell["execution_count"])
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                problems.append(f"cell {i} saved an error: {out.get('ename')}: {out.get('evalue')}")
    if counts != sorted(set(counts)):
        problems.append(f"cells were not run top to bottom (execution counts {counts})")
    assert not problems, (
        f"{path.name} must be saved executed, top to bottom, without errors (see CONTRIBUTING.md, step 3):\n  "
        + "\n  ".join(problems)
    )


# --- the package imports on a CPU-only machine without flash-attn -----------------------------------------------

# Runs in a fresh interpreter with every GPU hidden and `import flash_attn` and `import gguf` failing as if those
# packages were absent (gguf is the extra for GGUF checkpoints: the package must import without it).
IMPORT_WITHOUT_GPU = r"""
import importlib, importlib.abc, json, pkgutil, sys, traceback

class NoFlashAttn(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("flash_attn", "gguf"):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
        return None

sys.meta_path.insert(0, NoFlashAttn())
result = {"package": None, "modules": {}}
try:
    import nanoengine
    from nanoengine import SamplingParams
    import torch
    assert not torch.cuda.is_available(), "CUDA_VISIBLE_DEVICES='' should hide every GPU"
except BaseException:
    result["package"] = traceback.format_exc()
else:
    for mod in pkgutil.walk_packages(nanoengine.__path__, "nanoengine."):
        try:
            importlib.import_module(mod.name)
        except BaseException:
            result["modules"][mod.name] = traceback.format_exc(limit=-3)
print("RESULT=" + json.dumps(result))
"""


@pytest.fixture(scope="module")
def cpu_import() -> dict:
    """Import nanoengine, then every one of its modules, on a simulated machine without GPU and flash-attn."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_WITHOUT_GPU], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT=")]
    assert proc.returncode == 0 and line, f"the import probe crashed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(line[-1].removeprefix("RESULT="))


def test_package_imports_without_gpu_or_flash_attn(cpu_import):
    assert cpu_import["package"] is None, cpu_import["package"]


def test_every_module_imports_without_gpu_or_flash_attn(cpu_import):
    """Chapters import these modules on a CPU; GPU-only imports must be guarded."""
    assert cpu_import["package"] is None, "`import nanoengine` itself fails; see the test above"
    failed = cpu_import["modules"]
    assert not failed, "modules that do not import without a GPU or flash-attn:\n" + "\n".join(
        f"{name}:\n{tb}" for name, tb in failed.items()
    )
