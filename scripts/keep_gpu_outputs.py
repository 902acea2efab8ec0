"""Copy the outputs of the GPU-only cells (`# NBVAL_SKIP`) from notebooks executed by
scripts/gpu_check.py into notebooks/, so the site shows what they print on a GPU. Each such cell
gets a short last line, e.g. `[H200 output · how it was measured: appendix]`, which points to the
book's appendix (book/measurements.md); the full provenance (GPU, commit, date, versions) is in
benchmarks/gpu_check.json. CI keeps skipping these cells, so their saved outputs are never compared.

    python scripts/keep_gpu_outputs.py EXECUTED_DIR [--summary benchmarks/gpu_check.json]
    python scripts/keep_gpu_outputs.py --shorten-footers [NOTEBOOK ...]

The second form rewrites the long footers of earlier runs ("[output of this cell on an NVIDIA H200
(torch ..., flash-attn ...), commit ..., DATE: scripts/gpu_check.py]") in the notebooks' saved
outputs to the short one, in place, changing nothing else in the files (default: every notebook
under notebooks/).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
MARK = "# NBVAL_SKIP"


# The footer of earlier runs, 134 characters: it made the outputs scroll sideways on the site.
LONG_FOOTER = re.compile(
    r"\[output of this cell on (?:an? )?(?P<gpu>[^\]\"\\(]*?) \([^\]\"\\]*\), "
    r"commit [0-9a-f]+, [0-9-]+: scripts/gpu_check\.py\]"
)


def gpu_name(gpu: str, num_gpus: int = 1) -> str:
    """'NVIDIA H200' -> 'H200'; two of them -> '2 × H200'."""
    name = gpu.removeprefix("NVIDIA ").strip() or "GPU"
    return f"{num_gpus} × {name}" if num_gpus > 1 else name


def footer(gpu: str, num_gpus: int = 1) -> str:
    """The short last line of a GPU cell's output (well under 80 characters)."""
    return f"[{gpu_name(gpu, num_gpus)} output · how it was measured: appendix]"


def provenance_line(prov: dict) -> str:
    """The line under a GPU cell's output: the GPU, and where the rest of the provenance is."""
    return footer(prov["gpu"], prov.get("num_gpus", 1)) + "\n"


def shorten_footers(path: Path) -> int:
    """Rewrite the long footers in a notebook's saved outputs to the short one, in place; returns
    how many. The file is edited as text, so nothing else in it changes (its JSON escaping, key
    order, indentation)."""
    text = path.read_text(encoding="utf-8")
    new, count = LONG_FOOTER.subn(lambda m: footer(m.group("gpu")), text)
    if count:
        json.loads(new)  # still a notebook
        path.write_text(new, encoding="utf-8")
    return count


def keep(executed_dir: Path, summary: dict, names: set[str] | None = None) -> list[str]:
    """Merge the GPU cells' outputs of every notebook that ran cleanly (of `names`, if given) into
    the cells whose source is still the one that ran; returns 'notebook: cell id' per cell, and says
    which cells changed since."""
    prov, updated = summary["provenance"], []
    clean = {r["name"] for r in summary.get("notebooks", []) if r["ok"]}
    for executed_path in sorted(executed_dir.glob("*.ipynb")):
        target = ROOT / "notebooks" / executed_path.name
        if (
            not target.exists()
            or executed_path.stem not in clean
            or (names and executed_path.stem not in names)
        ):
            continue
        ran = {
            c.get("id"): c
            for c in nbformat.read(executed_path, as_version=4).cells
            if c.cell_type == "code"
        }
        nb = nbformat.read(target, as_version=4)
        changed = False
        for cell in nb.cells:
            if (
                cell.cell_type != "code"
                or not cell.source.startswith(MARK)
                or cell.get("id") not in ran
            ):
                continue
            if ran[cell.id].source != cell.source:
                print(f"{target.name}: {cell.id} changed since the GPU run: its output is not kept")
                continue
            outputs = [o for o in ran[cell.id].outputs if o.get("output_type") != "error"]
            outputs.append(
                nbformat.v4.new_output("stream", name="stdout", text=provenance_line(prov))
            )
            cell.outputs = outputs
            changed = True
            updated.append(f"{target.name}: {cell.id}")
        if changed:
            nbformat.write(nb, target)
    return updated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("executed", type=Path, nargs="?", help="the executed notebooks' folder")
    parser.add_argument("--summary", type=Path, default=ROOT / "benchmarks" / "gpu_check.json")
    parser.add_argument(
        "--notebooks", nargs="*", default=None, help="names (stems) to update; default: all"
    )
    parser.add_argument(
        "--shorten-footers",
        nargs="*",
        type=Path,
        metavar="NOTEBOOK",
        default=None,
        help="rewrite the long footers of earlier runs to the short one (default: notebooks/)",
    )
    args = parser.parse_args()
    if args.shorten_footers is not None:
        for path in args.shorten_footers or sorted((ROOT / "notebooks").glob("*.ipynb")):
            if count := shorten_footers(path):
                print(f"{path.name}: {count} footer(s) shortened")
        return
    if args.executed is None:
        parser.error("EXECUTED_DIR is required (or --shorten-footers)")
    names = set(args.notebooks) if args.notebooks else None
    for line in keep(args.executed, json.loads(args.summary.read_text()), names):
        print(line)


if __name__ == "__main__":
    main()
