"""Draw the optimisation index's figure, book/figures/ladder.svg, from benchmarks/h200.json's
`ablations`: what the engine makes without each optimisation, in throughput and in batch-1 latency,
against the full engine.

    python scripts/ladder_figure.py [--json benchmarks/h200.json] [--out book/figures/ladder.svg]

Re-run it whenever the ablations in benchmarks/h200.json change; tests/test_numbers.py checks that
the committed figure shows the JSON's numbers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FULL = "all optimisations"
# The rungs the index lists, with the name a reader sees (the ladder's rung names stay as h200.json
# has them). "no one-copy decode inputs" is history: still in the JSON, no longer an optimisation of
# the engine.
RUNGS = {
    "no CUDA graphs": "CUDA graphs",
    "no async scheduling": "async scheduling",
    "no Triton decode": "Triton decode attention",
    "no one-pass sampler": "one-pass sampler",
    "no fused RoPE + store": "fused RoPE + KV store",
    "no longest-first decode": "longest first",
    "no Triton prologue kernels": "prologue kernels",
    "no batched text decode": "batched text decode",
    "no cached activation memory": "cached activation memory",
    "no torch.compile": "torch.compile",
    "no Triton GEMV": "Triton GEMV",
    "no fused prologues": "fused prologues",
    "no prefix caching": "prefix caching",
    "no split mixed steps": "split mixed steps",
    "no prompt steps planned ahead": "prompt steps planned ahead",
}
CLIP = 40  # bars longer than CLIP percent are cut, their value printed


def figure_data(results: dict) -> dict:
    """What the figure plots: the full engine's throughput and batch-1 latency, then each rung's
    (label, tok/s, ms per token), the largest throughput loss first."""
    ladder = results["ablations"]
    rungs = [
        (label, ladder[rung]["output_tok_per_s"], ladder[rung]["latency_ms_per_token"])
        for rung, label in RUNGS.items()
    ]
    rungs.sort(key=lambda r: r[1])
    full = ladder[FULL]
    return {
        "full": (full["output_tok_per_s"], full["latency_ms_per_token"]),
        "rungs": rungs,
        "spread": (
            results["headline"]["output_tok_per_s_range"],
            results["headline"]["ms_per_token_range"],
        ),
    }


def labels(data: dict) -> list[str]:
    """The value labels printed at the figure's bars, in drawing order (tests compare them with the
    JSON)."""
    return [f"{tok:,.0f}" for _, tok, _ in data["rungs"]] + [
        f"{ms:.3f}" for _, _, ms in data["rungs"]
    ]


def draw(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "svg.fonttype": "none",
            "svg.hashsalt": "nanoengine",
            "font.size": 12,
            "font.family": "sans-serif",
        }
    )
    names = [label for label, _, _ in data["rungs"]]
    full_tok, full_ms = data["full"]
    (tok_lo, _), (_, ms_hi) = data["spread"]
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(8.4, 6.2), sharey=True, gridspec_kw={"wspace": 0.05}
    )
    panels = (
        (
            left,
            [100 * (1 - t / full_tok) for _, t, _ in data["rungs"]],
            [f"{t:,.0f}" for _, t, _ in data["rungs"]],
            100 * (1 - tok_lo / full_tok),
            f"throughput lost, %\n(all on: {full_tok:,.0f} tok/s)",
        ),
        (
            right,
            [100 * (m / full_ms - 1) for _, _, m in data["rungs"]],
            [f"{m:.3f}" for _, _, m in data["rungs"]],
            100 * (ms_hi / full_ms - 1),
            f"batch-1 time added, %\n(all on: {full_ms:.3f} ms/token)",
        ),
    )
    for ax, losses, texts, band, title in panels:
        ax.axvspan(0, band, color="#718096", alpha=0.3, lw=0)
        for i, (loss, text) in enumerate(zip(losses, texts)):
            shown = min(max(loss, 0), CLIP)
            ax.barh(i, shown, color="#3182ce", height=0.7)
            ax.text(
                shown + 0.8, i, text + (" \u2192" if loss > CLIP else ""), va="center", fontsize=12
            )
        ax.set_xlim(0, CLIP * 1.45)
        ax.set_title(title, fontsize=13)
        ax.tick_params(labelsize=12)
        ax.spines[["top", "right"]].set_visible(False)
        ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator([0, 10, 20, 30, 40]))
    left.set_yticks(list(range(len(names))), names, fontsize=12)
    left.invert_yaxis()
    fig.subplots_adjust(left=0.335, right=0.985, top=0.9, bottom=0.06)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(
        out,
        format=out.suffix.lstrip("."),
        metadata={"Date": None} if out.suffix == ".svg" else None,
    )
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "h200.json")
    parser.add_argument("--out", type=Path, default=ROOT / "book" / "figures" / "ladder.svg")
    args = parser.parse_args()
    draw(figure_data(json.loads(args.json.read_text(encoding="utf-8"))), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
