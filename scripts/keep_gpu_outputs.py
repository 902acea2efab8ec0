"""Copy the outputs of the GPU-only cells (`# NBVAL_SKIP`) from notebooks executed by scripts/gpu_check.py into
notebooks/, so the site shows what they print on a GPU. Each such cell gets a last line saying where and at which
commit it ran. CI keeps skipping these cells, so their saved outputs are never compared.

    python scripts/keep_gpu_outputs.py EXECUTED_DIR [--summary benchmarks/gpu_check.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
MARK = "# NBVAL_SKIP"


def provenance_line(prov: dict) -> str:
    """One line naming the GPU, the commit and the date of the run."""
    return (f"[output of this cell on an {prov['gpu']} (torch {prov['torch']}, flash-attn {prov['flash_attn']}), "
            f"commit {prov['commit'][:7]}, {prov['date'][:10]}: scripts/gpu_check.py]\n")


def keep(executed_dir: Path, summary: dict, names: set[str] | None = None) -> list[str]:
    """Merge the GPU cells' outputs of every notebook that ran cleanly (of `names`, if given) into the cells whose
    source is still the one that ran; returns 'notebook: cell id' per cell, and says which cells changed since."""
    prov, updated = summary["provenance"], []
    clean = {r["name"] for r in summary.get("notebooks", []) if r["ok"]}
    for executed_path in sorted(executed_dir.glob("*.ipynb")):
        target = ROOT / "notebooks" / executed_path.name
        if not target.exists() or executed_path.stem not in clean or (names and executed_path.stem not in names):
            continue
        ran = {c.get("id"): c for c in nbformat.read(executed_path, as_version=4).cells if c.cell_type == "code"}
        nb = nbformat.read(target, as_version=4)
        changed = False
        for cell in nb.cells:
            if cell.cell_type != "code" or not cell.source.startswith(MARK) or cell.get("id") not in ran:
                continue
            if ran[cell.id].source != cell.source:
                print(f"{target.name}: {cell.id} changed since the GPU run: its output is not kept")
                continue
            outputs = [o for o in ran[cell.id].outputs if o.get("output_type") != "error"]
            outputs.append(nbformat.v4.new_output("stream", name="stdout", text=provenance_line(prov)))
            cell.outputs = outputs
            changed = True
            updated.append(f"{target.name}: {cell.id}")
        if changed:
            nbformat.write(nb, target)
    return updated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("executed", type=Path)
    parser.add_argument("--summary", type=Path, default=ROOT / "benchmarks" / "gpu_check.json")
    parser.add_argument("--notebooks", nargs="*", default=None, help="names (stems) to update; default: all")
    args = parser.parse_args()
    names = set(args.notebooks) if args.notebooks else None
    for line in keep(args.executed, json.loads(args.summary.read_text()), names):
        print(line)


if __name__ == "__main__":
    main()
