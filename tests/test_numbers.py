"""One source for every number: the prose's numbers come from benchmarks/*.json (the `num` role of
book/_ext/nanoengine_book.py) or from a notebook's own computation (myst-nb's `glue`), never from a
keyboard.

(a) every `{num}` role of book/*.md and of the notebooks' markdown resolves: file, key and format,
    with the extension's own functions, so no book build is needed;
(b) prose carries no hand-typed measured number (digits followed by a unit) outside a role, inline
    code, math or the short allow-list below, each entry with its reason. The scan runs on
    book/*.md and on the notebooks whose chapters are converted; NOT_YET_SCANNED lists the others.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "book" / "_ext"))
import nanoengine_book as ext  # noqa: E402

BOOK_PAGES = sorted((REPO / "book").glob("*.md"))
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))

# TODO(issue 40): the notebooks whose markdown still carries typed numbers (on 4 December 2026,
# 556 in all, 192 of them in 13_benchmarks). As a chapter is converted (its numbers read from
# benchmarks/*.json with {num}, or glued from its own cells with myst-nb's `glue`), delete its
# name here: test_prose_has_no_hand_typed_numbers then scans it. Every other notebook is scanned
# already. `hand_typed_numbers([path])` lists what is left in one notebook.
NOT_YET_SCANNED: list[str] = []

# Literals that stay typed, each group with its reason: (page, the exact phrases around the numbers,
# why). Every phrase must still occur on its page (test_allow_list_is_used), so a stale entry fails
# too.
QWEN3_ARITHMETIC = ("Qwen3-0.6B's shape (the page's first table) and the H200's two roofline "
                    "constants, worked through in the formulas on the page: arithmetic on "
                    "definitions, which changes only with the model")
ALLOWED = [
    ("07a_fp8_kv.ipynb", ["about 6%. bfloat16", "at most about 6% of a number's size",
                          "(at most about 6% rounding error)"],
     "e4m3's half-step, 1/16 of a value: a constant of the format, derived in the same sentence"),
    ("07a_fp8_kv.ipynb", ["well within 1%. With keys 64 times"],
     "the 1% bound the engine is held to (issue 43's accuracy criterion) and the gain of 64 the "
     "chapter's code sets as its input"),
    ("five_ideas.md",
     ["about 4.3 TB/s of memory bandwidth (as we measured it)", "about 790 TFLOP/s of dense bf16"],
     "the H200's two roofline constants: its measured copy bandwidth and its datasheet's bf16 "
     "peak, which the formulas on the page divide by (chapter 00 uses the same two)"),
    ("five_ideas.md",
     ["1.19 GB", "1.2 GFLOP", "305 GFLOP", "902 GFLOP", "0.28 ms", "0.0015 ms", "0.39 ms",
      "1.14 ms", "about 180 times less", "448 MiB", "382 MiB", "= 512 KiB", "to 56 KiB per token"],
     QWEN3_ARITHMETIC),
    ("glossary.md", ["costs 112 KiB per token", "all 1.19 GB of weights"],
     "Qwen3-0.6B's KV bytes per token and weight bytes: definitions, derived on the five ideas "
     "page"),
    ("five_ideas.md", ["the usual 90% of its memory"],
     "the default gpu_memory_utilization, a setting"),
    ("gpu.md", ["(default 0.9)", "share a GPU at 0.45 each", "with 1 GiB of headroom"],
     "settings: the default gpu_memory_utilization, an example share, and GPU_HEADROOM_BYTES "
     "(engine/model_runner.py)"),
    ("00_orientation.ipynb",
     ["Qwen3-8B hold on an 80 GiB GPU", "Qwen3-0.6B in bf16 on an 80 GiB card"],
     "GPU sizes the chapter gives as inputs: its opening question and the page calculator's "
     "default (the HTML input's value), not results"),
    ("00_orientation.ipynb", ["Blocks in 40 GiB", "has exactly 40 GiB left"],
     "the exercise's given (the memory left for the KV cache), from which the reader computes"),
    ("03_scheduler.ipynb",
     ['style="width:100%;max-width:32em"', "border-collapse:collapse;width:100%"],
     "CSS widths in the scheduler stepper's HTML markup, not numbers of the engine"),
    ("flash_attn.md", ["a ~15 MB extension", "tens of GB of memory"],
     "sizes of builds of flash-attn (the trimmed one's file, a full source build's need), not of "
     "the engine"),
    ("15_serve.ipynb", ["every 5 ms by default"],
     "CPython's default switch interval (sys.getswitchinterval()), a setting of the interpreter"),
    ("15b_server.ipynb",
     ["`--max-body-bytes`, 8 MiB by default", "`--header-timeout`, 10 s by default",
      "`--body-timeout`, 30 s by default"],
     "the server's default limits, settings (MAX_BODY_BYTES, HEADER_TIMEOUT_S, BODY_TIMEOUT_S in "
     "serve.py)"),
    ("05_qwen3.ipynb", ["how many tokens fit in 10 GiB"],
     "the exercise's given (the memory for the KV cache), from which the reader computes"),
    ("08a_paged_decode.ipynb", ["The weights, 1.19 GB,", "measured copy bandwidth is about 4.3 TB/s"],
     "Qwen3-0.6B's weight bytes (a definition, as in glossary.md) and the H200's measured copy "
     "bandwidth, the roofline constant chapter 00 and five_ideas.md use (the sweep's figure draws "
     "its line at it)"),
    ("08a_paged_decode.ipynb", ["come within 5% of it"],
     "the exercise's given: the threshold the reader counts against (0.95 in its solution)"),
    ("11c_rope_store.ipynb", ["At the H200's 4.8 TB/s"],
     "the H200's datasheet memory bandwidth, a given of the exercise (its answer cell divides by "
     "4.8e12)"),
    ("14_tensor_parallel.ipynb", ["a pipe buffers only 64 KiB"],
     "Linux's default pipe capacity, a constant of the operating system"),
    ("14_tensor_parallel.ipynb", ["one 1 MiB POSIX shared-memory", "fixed 1 MiB segment"],
     "nano-vllm's fixed shared-memory segment size, a constant of its source"),
    ("14_tensor_parallel.ipynb", ["We aimed for 1.3×"],
     "the target set for two GPUs before measuring, not a result"),
    ("14_tensor_parallel.ipynb", ["sends a 16 KiB pickled message"],
     "exercise 1's given message size, from which the reader computes"),
    ("14b_torchrun.ipynb",
     ["NVLink moves roughly 900 GB/s per H200", "InfiniBand adapter moves 50 GB/s"],
     "hardware datasheet constants: NVLink's bandwidth per H200, and a 400 Gb/s InfiniBand "
     "adapter's in bytes (400/8)"),
]

# digits (with thousands commas and decimals), a space or none, then a unit of measurement
NUMBER = r"(?<![\w.,/])\d[\d,]*(?:\.\d+)?"
UNIT = (
    r"(?:(?:output |generated )?tok/s|tokens/s|(?:output |generated )?tokens per second|TB/s|GB/s|TFLOP/s|GFLOP|GB|MB|"
    r"GiB|MiB|KiB|ms|µs|us|s|%|×|times)"
)
MEASURED = re.compile(rf"{NUMBER}(?:[ \u00a0\u202f]?{UNIT}|x)(?![\w/])")  # 4.0x, but not 256 x 512
# what the scan skips: roles, inline code, math, fenced code, link targets and HTML comments
_SKIP = [
    re.compile(r"\{[\w:-]+\}`[^`]*`"),  # {num}`...`, {glue:text}`...`, {term}`...`, any role
    re.compile(r"``[^`]+``|`[^`\n]+`"),  # inline code
    re.compile(r"\$\$.*?\$\$", re.S),  # display math
    re.compile(r"(?<![\\$])\$[^$\n]+\$"),  # inline math
    re.compile(r"\]\([^)]*\)"),  # a link's target
    re.compile(r"<!--.*?-->", re.S),
]
_FENCE = re.compile(r"^(`{3,}|~{3,}|:{3,})(.*)$")


def blank(text: str, start: int, end: int) -> str:
    """`text` with [start, end) replaced by spaces (newlines kept), so positions and lines stay."""
    return text[:start] + re.sub(r"[^\n]", " ", text[start:end]) + text[end:]


def prose(markdown: str) -> str:
    """The markdown with code, math and roles blanked out: what the scan reads. Directives' bodies
    (a figure's caption and alt text, the glossary) stay, since a reader reads them; their fences
    and options go."""
    lines = markdown.split("\n")
    fences: list[tuple[str, bool]] = []  # open fences, innermost last: (marker, holds code)
    for i, line in enumerate(lines):
        stripped = line.strip()
        m = _FENCE.match(stripped)
        if fences and stripped == fences[-1][0]:
            fences.pop()
            lines[i] = " " * len(line)
        elif fences and fences[-1][1]:
            lines[i] = " " * len(line)
        elif m:
            fences.append(
                (
                    m.group(1),
                    not m.group(2).strip().startswith("{") or m.group(2).startswith("{code"),
                )
            )
            lines[i] = " " * len(line)
        elif re.match(r"\s*:(?!alt:)[\w-]+:", line):
            lines[i] = " " * len(line)  # a directive's option (:width: 100%)
    text = "\n".join(lines)
    for pattern in _SKIP:
        for m in reversed(list(pattern.finditer(text))):
            text = blank(text, m.start(), m.end())
    return text


def markdown_chunks(path: Path) -> list[tuple[str, str]]:
    """(where, markdown) of a page: the whole .md, or each markdown cell of a notebook."""
    if path.suffix == ".md":
        return [(path.name, path.read_text(encoding="utf-8"))]
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return [
        (f"{path.name} cell {i}", "".join(c["source"]))
        for i, c in enumerate(cells)
        if c["cell_type"] == "markdown"
    ]


def phrase_pattern(phrase: str) -> str:
    """An allow-list phrase as a pattern: any run of white space (a line break) matches its spaces.
    """
    return r"\s+".join(re.escape(word) for word in phrase.split())


def hand_typed_numbers(paths: list[Path], allowed=ALLOWED) -> list[str]:
    """'page:line: number unit in «context»' for every measured-looking number outside roles, code
    and math."""
    found = []
    for path in paths:
        phrases = [phrase for page, group, _ in allowed if page == path.name for phrase in group]
        for where, markdown in markdown_chunks(path):
            text = prose(markdown)
            spans = [
                (m.start(), m.end())
                for phrase in phrases
                for m in re.finditer(phrase_pattern(phrase), markdown)
            ]
            for m in MEASURED.finditer(text):
                if any(a <= m.start() and m.end() <= b for a, b in spans):
                    continue
                line = text.count("\n", 0, m.start()) + 1
                context = " ".join(markdown[max(0, m.start() - 40) : m.end() + 20].split())
                found.append(f"{where}:{line}: {m.group(0)!r} in «{context}»")
    return found


def num_roles(paths: list[Path]) -> list[tuple[str, int, str]]:
    """(where, line, text) of every {num} role in the pages' markdown."""
    return [
        (where, line, text)
        for path in paths
        for where, markdown in markdown_chunks(path)
        for line, text in ext.find_num_roles(markdown)
    ]


# --- (a) every {num} resolves ---------------------------------------------------------------------


def test_every_num_role_resolves():
    roles = num_roles(BOOK_PAGES + NOTEBOOKS)
    assert len(roles) >= 100, (
        f"only {len(roles)} {{num}} roles found: has the role's syntax changed?"
    )
    problems = []
    for where, line, text in roles:
        try:
            ext.render_num(text)
        except ext.NumError as exc:
            problems.append(f"{where}:{line}: {{num}}`{text}`: {exc}")
    assert not problems, "numbers whose source is missing:\n" + "\n".join(problems)


def test_num_role_reads_paths_formats_and_expressions(tmp_path):
    (tmp_path / "run.json").write_text(
        json.dumps(
            {
                "a": {"b c": [10, 20.5]},
                "tok_s": 26256,
                "base": 6484.2,
                "date": "2026-12-03T21:41:39",
                "rows": [{}, {}],
            }
        )
    )
    assert ext.render_num("run.json:tok_s", tmp_path) == "26,256"
    assert ext.render_num('run.json:a["b c"][1]:.2f', tmp_path) == "20.50"
    assert ext.render_num('run.json:a["b c"][-1]:.1f', tmp_path) == "20.5"
    assert ext.render_num("run.json:date:.10", tmp_path) == "2026-12-03"
    assert ext.render_num("run.json:tok_s / run.json:base:.1f", tmp_path) == "4.0"
    assert ext.render_num("run.json:base / run.json:tok_s - 1:+.0%", tmp_path) == "\u221275%"
    assert ext.render_num("len(run.json:rows)", tmp_path) == "2"
    assert ext.render_num('max(run.json:a["b c"]) * 1000:,.0f', tmp_path) == "20,500"
    spec = ext.parse_num('h200.json:ablations["no CUDA graphs"].output_tok_per_s:,.0f')
    assert (
        spec.references[0].path == ("ablations", "no CUDA graphs", "output_tok_per_s")
        and spec.fmt == ",.0f"
    )


@pytest.mark.parametrize(
    "text, says",
    [
        ("missing.json:a", "no file benchmarks/missing.json"),
        ("run.json:a.nope", "no key 'nope' in a"),
        ('run.json:a["b c"][5]', "has 2 items, no index [5]"),
        ("run.json:base", "give it a format spec"),
        ("run.json:tok_s:.1q", "format spec '.1q' does not apply"),
        ("run.json:a", "not a number or a string"),
        ("run.json:tok_s ** 2", "only references, numbers"),
        ("__import__('os').system('true')", "no `FILE.json:key` reference"),
        ("run.json:tok_s + __import__('os'):d", "only references, numbers"),
        ("run.json:date + 1", "not a number to compute with"),
    ],
)
def test_num_role_names_what_is_wrong(tmp_path, text, says):
    (tmp_path / "run.json").write_text(
        json.dumps({"a": {"b c": [1, 2]}, "tok_s": 5, "base": 1.5, "date": "x"})
    )
    with pytest.raises(ext.NumError, match=re.escape(says)):
        ext.render_num(text, tmp_path)


# --- (b) no hand-typed numbers --------------------------------------------------------------------


def test_prose_has_no_hand_typed_numbers():
    scanned = BOOK_PAGES + [p for p in NOTEBOOKS if p.stem not in NOT_YET_SCANNED]
    found = hand_typed_numbers(scanned)
    assert not found, (
        "numbers typed into the prose (read them from benchmarks/*.json with {num}, glue a "
        "notebook's own with myst-nb's glue, or, for a constant or a setting, add it to ALLOWED "
        "with its reason):\n"
        + "\n".join(found)
    )


def test_the_scan_catches_typed_numbers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "It made 26,256 tok/s, 4.0× faster, in 0.716 ms and 5.1 s; 92% of 1.19 GB at 4.3 TB/s, "
        "3.7 times.\nNot these: {num}`h200.json:headline.ms_per_token_median:.3f` ms, `12 ms`, "
        "$0.28\\ \\text{ms}$,\n"
        "chapter 13, 256 requests, a 1,024-token prompt, [a link](x_12ms.md), 256 x 512 keys.\n"
        "```python\nprint('5 ms')\n```\n"
        "```{figure} f.svg\n:width: 100%\n\nA caption at 7 ms.\n```\n"
    )
    found = hand_typed_numbers([page], allowed=[])
    typed = [re.search(r"'(.*?)'", f).group(1) for f in found]
    assert typed == [
        "26,256 tok/s",
        "4.0×",
        "0.716 ms",
        "5.1 s",
        "92%",
        "1.19 GB",
        "4.3 TB/s",
        "3.7 times",
        "7 ms",
    ], found
    assert (
        hand_typed_numbers([page], allowed=[("page.md", ["at 7 ms"], "test")])[-1].find("7 ms")
        == -1
    )


def test_allow_list_is_used():
    for page, phrases, reason in ALLOWED:
        assert reason and len(reason) > 10, f"{page}: {phrases!r} needs a reason"
        text = (
            (REPO / "book" / page).read_text(encoding="utf-8")
            if page.endswith(".md")
            else "\n".join(md for _, md in markdown_chunks(REPO / "notebooks" / page))
        )
        for phrase in phrases:
            assert re.search(phrase_pattern(phrase), text), (
                f"ALLOWED names {phrase!r} on {page}, which no longer has it: delete the entry"
            )


def test_not_yet_scanned_is_current():
    stems = {p.stem for p in NOTEBOOKS}
    stale = sorted(set(NOT_YET_SCANNED) - stems)
    assert not stale, f"NOT_YET_SCANNED names notebooks that do not exist (renamed?): {stale}"


# --- reading times --------------------------------------------------------------------------------


def test_reading_time_counts_prose_and_code(tmp_path):
    page = tmp_path / "p.md"
    words = " ".join(["word"] * 440)
    code = "\n".join(f"x = {i}" for i in range(60))
    page.write_text(
        f"# Title\n\n{words}\n\n```python\n{code}\n```\n\n"
        "```{figure} a.svg\n:width: 50%\n\nCap.\n```\n"
    )
    assert ext.page_counts(page) == (440 + 1 + 1, 60)  # the title's word, the caption's word
    assert ext.reading_minutes(page) == 5 * round(
        (442 / ext.WORDS_PER_MINUTE + 60 / ext.CODE_LINES_PER_MINUTE) / 5
    )
    nb = tmp_path / "n.ipynb"
    cells = [
        {"cell_type": "markdown", "metadata": {}, "source": [words]},
        {"cell_type": "code", "metadata": {}, "source": ["# NBVAL_SKIP\n#| export\n" + code]},
        {"cell_type": "code", "metadata": {"tags": ["remove-cell"]}, "source": [code]},
    ]
    nb.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    assert ext.page_counts(nb) == (440, 60)


# --- the chapters speak of the engine -------------------------------------------------------------

PROVENANCE_PAGE = "measurements.md"  # the one page that names versions (commits) of the code
COMMIT = re.compile(r"(?<![\w/.-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w/-])")


def test_book_pages_name_no_commits():
    found = []
    for path in BOOK_PAGES:
        if path.name == PROVENANCE_PAGE:
            continue
        text = path.read_text(encoding="utf-8")
        found += [
            f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
            for m in COMMIT.finditer(text)
        ]
        found += [
            f"{path.name}:{line}: {{num}}`{role}`"
            for line, role in ext.find_num_roles(text)
            if re.search(r"\.commit\b|provenance", role)
        ]
    assert not found, (
        f"commit hashes or provenance outside {PROVENANCE_PAGE} (move them there):\n"
        + "\n".join(found)
    )


# --- the optimisation index's figure --------------------------------------------------------------

LADDER_SVG = REPO / "book" / "figures" / "ladder.svg"
TEXT_COLUMN_PX = (
    560  # the narrowest the book's text column gets at 1280 px and up (a conservative bound)
)


def test_ladder_figure_shows_the_jsons_numbers():
    """book/figures/ladder.svg is drawn by scripts/ladder_figure.py from benchmarks/h200.json: the
    values it plots are the JSON's, and the committed SVG still prints them (re-run the script when
    the ablations change)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import ladder_figure

    results = json.loads((REPO / "benchmarks" / "h200.json").read_text(encoding="utf-8"))
    data = ladder_figure.figure_data(results)
    ladder = results["ablations"]
    assert data["full"] == (
        ladder["all optimisations"]["output_tok_per_s"],
        ladder["all optimisations"]["latency_ms_per_token"],
    )
    for (label, tok, ms), rung in zip(
        sorted(data["rungs"]), sorted(ladder_figure.RUNGS.items(), key=lambda r: r[1])
    ):
        assert (label, tok, ms) == (
            rung[1],
            ladder[rung[0]]["output_tok_per_s"],
            ladder[rung[0]]["latency_ms_per_token"],
        )
    assert "no one-copy decode inputs" not in ladder_figure.RUNGS, (
        "a rung of history, not an optimisation"
    )
    svg = LADDER_SVG.read_text(encoding="utf-8")
    shown = {t.strip().rstrip(" \u2192") for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg)}
    missing = [label for label in ladder_figure.labels(data) if label not in shown]
    full = [f"all on: {data['full'][0]:,.0f} tok/s", f"all on: {data['full'][1]:.3f} ms/token"]
    missing += [text for text in full if not any(text in t for t in shown)]
    assert not missing, (
        f"{LADDER_SVG.name} does not show {missing}: run `python scripts/ladder_figure.py`"
    )
    width = float(re.search(r'viewBox="0 0 ([\d.]+)', svg).group(1))
    smallest = (
        min(float(s) for s in re.findall(r"font-size: ([\d.]+)px", svg)) * TEXT_COLUMN_PX / width
    )
    assert smallest >= 11, (
        f"{LADDER_SVG.name}'s smallest text is {smallest:.1f} px in a {TEXT_COLUMN_PX} px column"
    )
