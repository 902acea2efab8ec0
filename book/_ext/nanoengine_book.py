"""Sphinx extension for the nanoengine book: what a reader should and should not see on the site.

Numbers in the prose (for the authors of chapters)
==================================================

No measured or computed number is typed into the prose: it is inserted when the book is built,
from where it was measured, so that it cannot drift from its source.

* **A number measured on a GPU** lives in a committed JSON file under `benchmarks/`. Insert it
  with the `num` role, which works in `book/*.md` pages and in notebooks' markdown cells alike::

      nanoengine makes {num}`h200.json:headline.output_tok_per_s_median` output tokens per
      second, and {num}`h200.json:headline.ms_per_token_median:.3f` ms per token at batch 1.

  The role's text is `FILE:PATH[:FORMAT]`:

  - `FILE` is a JSON file under `benchmarks/` (`h200.json`, `h200x2.json`, `serve_h200.json`);
  - `PATH` walks into it: `.name` for a key, `[3]` for a list index (`[-1]` is the last), and
    `["any key"]` for a key with other characters than letters, digits and `_`:
    `h200.json:ablations["no CUDA graphs"].output_tok_per_s`;
  - `FORMAT` (optional) is a Python format spec, as in an f-string: `,.0f`, `.3f`, `.1%`,
    `+z.0%`. Integers default to `,` (`26,256`); a float needs a spec, so that its rounding is
    chosen, not accidental. A string takes a string spec (`.10` keeps a date's first ten
    characters). A leading minus sign is printed as a true minus (U+2212).

  A small arithmetic form derives a figure from others, so that a ratio or a change is never
  typed either: `+ - * /`, parentheses, number literals, and `min max abs len sum` over
  references (`len` and `sum` take lists). Only that: no attribute access, no other names::

      {num}`h200.json:a.tok_s / h200.json:b.tok_s:.1f` times faster
      {num}`h200.json:a.tok_s / h200.json:b.tok_s - 1:+z.0%` (a change, e.g. +16%)

  The unit stays in the prose, after the role. A file or key that does not exist, or a format
  that does not apply, fails the build (with or without -W) with a message naming the page, the
  line, the file and the key. `tests/test_numbers.py` checks every `num` role of `book/*.md`
  and `notebooks/*.ipynb` without a build, with this module's `find_num_roles` and
  `render_num`, and scans the prose for numbers typed by hand.

* **A number a notebook computes itself** (a count, a simulated result, a size) is glued with
  myst-nb's `glue`. In a code cell: `from myst_nb import glue` and
  `glue("steps_static", steps_static, display=False)`; in the markdown,
  `` {glue:text}`steps_static:,` `` prints it with a format spec. Another page pastes it with
  the notebook's path, `` {glue:text}`../notebooks/03_scheduler.ipynb::steps_static:,` ``. The
  notebook's saved outputs must hold the glued value: re-execute it after adding a `glue` call.

* **How a number was measured** (machine, script, command, processes, spreads, commits) is not
  told in the chapters: `book/measurements.md`, the appendix "How the numbers were measured",
  tells it, and chapters link to it.

* **Reading times** are computed, not typed: `` {reading-time}`.` `` prints "about N minutes"
  for the page it is on, `` {reading-time}`../notebooks/05_qwen3.ipynb` `` for another page (a
  path relative to the page). The estimate is `reading_minutes`: prose at 220 words a minute
  plus code at 12 lines a minute (5 seconds a line), rounded to 5 minutes; hidden cells
  (`remove-cell`, `remove-input`) and outputs do not count.
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.config import Config
from sphinx.errors import ExtensionError

NBVAL_PREFIX = "# NBVAL_"  # test-runner markers (nbval): they mean nothing to a reader
REPO_BUTTONS = ("use_repository_button", "use_issues_button")
REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


# --- the `num` role: numbers from benchmarks/*.json ---------------------------------------------

class NumError(ValueError):
    """A `num` role that does not resolve: its message names the file and the key."""


_QUOTED = r'"[^"]*"|\'[^\']*\''
_SEGMENT = rf"\.[A-Za-z_][A-Za-z0-9_]*|\[(?:-?\d+|{_QUOTED})\]"
# FILE.json:PATH, PATH starting with a bare name or a bracket.
_REFERENCE = re.compile(
    rf"(?P<file>[A-Za-z0-9_][A-Za-z0-9_/-]*(?:\.[A-Za-z0-9_-]+)*\.json):"
    rf"(?P<path>(?:[A-Za-z_][A-Za-z0-9_]*|\[(?:-?\d+|{_QUOTED})\])(?:{_SEGMENT})*)"
)
_PATH_PART = re.compile(
    rf"(?P<name>[A-Za-z_][A-Za-z0-9_]*)|\[(?P<index>-?\d+)\]|\[(?P<key>{_QUOTED})\]|\."
)
NUM_ROLE = re.compile(r"\{num\}`([^`]*)`")
FUNCTIONS = {"min": min, "max": max, "abs": abs, "len": len, "sum": sum}
_OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
              ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


@dataclass(frozen=True)
class Reference:
    """One `FILE:PATH` of a `num` role."""

    file: str
    path: tuple[str | int, ...]
    text: str  # as written


@dataclass(frozen=True)
class NumSpec:
    """A parsed `num` role: an expression over references (`_r0`, `_r1`, ...) and a format spec."""

    text: str
    expression: str
    references: tuple[Reference, ...]
    fmt: str | None


def parse_path(path: str) -> tuple[str | int, ...]:
    """`a.b[0]["c d"]` -> ('a', 'b', 0, 'c d')."""
    parts, pos = [], 0
    while pos < len(path):
        m = _PATH_PART.match(path, pos)
        if m is None:
            raise NumError(f"cannot read the key path {path!r} at {path[pos:]!r}")
        if m.group("name"):
            parts.append(m.group("name"))
        elif m.group("index") is not None:
            parts.append(int(m.group("index")))
        elif m.group("key"):
            parts.append(m.group("key")[1:-1])
        pos = m.end()
    return tuple(parts)


def parse_num(text: str) -> NumSpec:
    """Parse a `num` role's text: `FILE:PATH[:FORMAT]`, or an expression over such references and
    then `[:FORMAT]`."""
    text = text.strip()
    refs: list[Reference] = []

    def placeholder(m: re.Match) -> str:
        refs.append(Reference(m.group("file"), parse_path(m.group("path")), m.group(0)))
        return f" _r{len(refs) - 1} "

    rest = _REFERENCE.sub(placeholder, text)
    if not refs:
        raise NumError(f"no `FILE.json:key` reference in {text!r}")
    expression, sep, fmt = rest.partition(":")
    expression = " ".join(expression.split())
    spec = NumSpec(text, expression, tuple(refs), fmt if sep else None)
    _check_expression(spec)
    return spec


def _check_expression(spec: NumSpec) -> ast.expr:
    try:
        tree = ast.parse(spec.expression, mode="eval").body
    except SyntaxError as exc:
        raise NumError(f"cannot read the expression {spec.text!r}: {exc.msg}") from None
    names = {f"_r{i}" for i in range(len(spec.references))}
    for node in ast.walk(tree):
        ok = isinstance(node, (ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop, ast.Load,
                               ast.Call))
        ok = ok or (isinstance(node, ast.Constant) and type(node.value) in (int, float))
        ok = ok or (isinstance(node, ast.Name) and (node.id in names or node.id in FUNCTIONS))
        if isinstance(node, ast.BinOp):
            ok = type(node.op) in _OPERATORS
        if isinstance(node, ast.UnaryOp):
            ok = isinstance(node.op, (ast.USub, ast.UAdd))
        if isinstance(node, ast.Call):
            ok = isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS and not node.keywords
        if not ok:
            raise NumError(f"{spec.text!r}: only references, numbers, + - * /, parentheses and "
                           f"{', '.join(FUNCTIONS)} are allowed (found {ast.dump(node)[:60]})")
    return tree


def benchmark_file(name: str, root: Path = BENCHMARKS) -> Path:
    """The path of `benchmarks/NAME`; refuses a name that leaves benchmarks/."""
    path = (root / name).resolve()
    if root.resolve() not in path.parents:
        raise NumError(f"{name!r} is not a file under benchmarks/")
    return path


_CACHE: dict[Path, tuple[float, Any]] = {}


def load_json(path: Path) -> Any:
    """A JSON file, read once per modification time."""
    mtime = path.stat().st_mtime
    cached = _CACHE.get(path)
    if cached is None or cached[0] != mtime:
        _CACHE[path] = (mtime, json.loads(path.read_text(encoding="utf-8")))
    return _CACHE[path][1]


def resolve(ref: Reference, root: Path = BENCHMARKS) -> Any:
    """The value `ref` names; NumError naming the file and the key if there is none."""
    path = benchmark_file(ref.file, root)
    if not path.is_file():
        raise NumError(f"no file benchmarks/{ref.file} (for key {ref.text.partition(':')[2]!r})")
    try:
        value = load_json(path)
    except json.JSONDecodeError as exc:
        raise NumError(f"benchmarks/{ref.file} is not valid JSON: {exc}") from None
    walked = []
    for part in ref.path:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in walked).lstrip(".")
        where = where or "the top level"
        if isinstance(part, int):
            if not isinstance(value, list):
                raise NumError(f"benchmarks/{ref.file}: {where} is not a list, "
                               f"so it has no index [{part}]")
            if not -len(value) <= part < len(value):
                raise NumError(f"benchmarks/{ref.file}: {where} has {len(value)} items, "
                               f"no index [{part}]")
        elif not isinstance(value, dict) or part not in value:
            keys = sorted(value)[:12] if isinstance(value, dict) else type(value).__name__
            raise NumError(f"benchmarks/{ref.file} has no key {part!r} in {where} (it has: {keys})")
        value = value[part]
        walked.append(part)
    return value


def _evaluate(node: ast.expr, values: dict[str, Any]) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return values[node.id]
    if isinstance(node, ast.UnaryOp):
        operand = _evaluate(node.operand, values)
        return -operand if isinstance(node.op, ast.USub) else +operand
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left, values), _evaluate(node.right, values)
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.Call):
        return FUNCTIONS[node.func.id](*(_evaluate(a, values) for a in node.args))
    raise NumError(f"cannot evaluate {ast.dump(node)[:60]}")


def evaluate(spec: NumSpec, root: Path = BENCHMARKS) -> Any:
    """The value of a parsed `num` role."""
    values = {f"_r{i}": resolve(ref, root) for i, ref in enumerate(spec.references)}
    tree = _check_expression(spec)
    if isinstance(tree, ast.Name) and tree.id.startswith("_r"):
        return values[tree.id]
    for ref, value in zip(spec.references, values.values()):
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (numeric or isinstance(value, list)):
            raise NumError(f"{ref.text} is {type(value).__name__} {value!r:.40}, "
                           "not a number to compute with")
    try:
        return _evaluate(tree, values)
    except (TypeError, ZeroDivisionError, ValueError) as exc:
        raise NumError(f"cannot compute {spec.text!r}: {exc}") from None


def format_value(value: Any, fmt: str | None, text: str = "") -> str:
    """`value` formatted by `fmt` (ints default to `,`, floats need a spec); a leading minus sign
    as U+2212."""
    if value is None or isinstance(value, (bool, dict, list)):
        raise NumError(f"{text!r} is {type(value).__name__} {value!r:.40}, "
                       "not a number or a string")
    if fmt is None:
        if isinstance(value, float):
            raise NumError(f"{text!r} is the float {value!r}: give it a format spec, "
                           "e.g. `:.2f` or `:,.0f`")
        fmt = "," if isinstance(value, int) else ""
    if isinstance(value, float) and not math.isfinite(value):
        raise NumError(f"{text!r} is {value!r}")
    try:
        shown = format(value, fmt)
    except (ValueError, TypeError) as exc:
        raise NumError(f"format spec {fmt!r} does not apply to {value!r:.40} ({text!r}): "
                       f"{exc}") from None
    return "\u2212" + shown[1:] if shown.startswith("-") and not isinstance(value, str) else shown


def render_num(text: str, root: Path = BENCHMARKS) -> str:
    """What the role `{num}` prints for `text`: parse, look up, compute, format."""
    spec = parse_num(text)
    return format_value(evaluate(spec, root), spec.fmt, text)


def num_files(text: str, root: Path = BENCHMARKS) -> list[Path]:
    """The JSON files a role's text names (the build's dependencies), without resolving them."""
    return [root / m.group("file") for m in _REFERENCE.finditer(text)]


def find_num_roles(markdown: str) -> list[tuple[int, str]]:
    """Every `{num}` role of a markdown text: (line number from 1, the role's text)."""
    return [(markdown.count("\n", 0, m.start()) + 1, m.group(1))
            for m in NUM_ROLE.finditer(markdown)]


def where(env, lineno: int) -> str:
    """A source line as an author finds it (myst-nb numbers notebook lines cell * 10000 + line)."""
    if str(env.doc2path(env.docname)).endswith(".ipynb") and lineno >= 10000:
        return f"{env.docname} (cell {lineno // 10000}, line {lineno % 10000})"
    return f"{env.docname}:{lineno}"


def _fail(inliner, lineno: int, rawtext: str, message: str):
    env = inliner.document.settings.env
    env.nanoengine_num_errors = getattr(env, "nanoengine_num_errors", [])
    env.nanoengine_num_errors.append((env.docname, lineno, where(env, lineno), message))
    msg = inliner.reporter.error(message, line=lineno)
    return [inliner.problematic(rawtext, rawtext, msg)], [msg]


def num_role(name, rawtext, text, lineno, inliner, options=None, content=()):
    """`{num}` FILE:PATH[:FORMAT] -> the number, from benchmarks/FILE."""
    env = inliner.document.settings.env
    for path in num_files(text):
        env.note_dependency(str(path))
    try:
        shown = render_num(text)
    except NumError as exc:
        return _fail(inliner, lineno, rawtext, f"{{num}}`{text}`: {exc}")
    return [nodes.inline(rawtext, shown, classes=["num"])], []


def purge_num_errors(app: Sphinx, env, docname: str) -> None:
    errors = getattr(env, "nanoengine_num_errors", [])
    env.nanoengine_num_errors = [e for e in errors if e[0] != docname]


def merge_num_errors(app: Sphinx, env, docnames, other) -> None:
    env.nanoengine_num_errors = getattr(env, "nanoengine_num_errors", []) + [
        e for e in getattr(other, "nanoengine_num_errors", []) if e[0] in docnames]


def fail_on_num_errors(app: Sphinx, env) -> None:
    """A `num` that did not resolve fails the build, with or without -W."""
    errors = sorted(getattr(env, "nanoengine_num_errors", []))
    if errors:
        raise ExtensionError(f"{len(errors)} number(s) of the prose did not resolve:\n"
                             + "\n".join(f"  {at}: {msg}" for _, _, at, msg in errors))


# --- reading times -------------------------------------------------------------------------------

WORDS_PER_MINUTE = 220  # prose
CODE_LINES_PER_MINUTE = 12  # code, read rather than skimmed: 5 seconds a line
HIDDEN_TAGS = {"remove-cell", "remove-input"}
_FENCE = re.compile(r"^(`{3,}|~{3,}|:{3,})\s*(.*)$")
_WORD = re.compile(r"[A-Za-z0-9][\w'’.-]*")


def _markdown_counts(text: str) -> tuple[int, int]:
    """(prose words, code lines) of a markdown text: fenced code counts as code, a directive's
    body (a figure's caption, the glossary) as prose; math counts as one word, links' targets not
    at all."""
    words = code = 0
    fences: list[tuple[str, bool]] = []  # the open fences, innermost last: (marker, holds code)
    for line in text.splitlines():
        stripped = line.strip()
        if fences and stripped == fences[-1][0]:
            fences.pop()
            continue
        if fences and fences[-1][1]:
            code += bool(stripped)
            continue
        m = _FENCE.match(stripped)
        if m:
            info = m.group(2)
            holds_code = m.group(1)[0] != ":" and (not info.startswith("{")
                                                   or info.startswith("{code"))
            fences.append((m.group(1), holds_code))
            continue
        if fences and stripped.startswith(":"):  # a directive's option
            continue
        line = re.sub(r"\]\([^)]*\)", "]", line)
        line = re.sub(r"\$[^$]*\$", " x ", line)
        words += len(_WORD.findall(line))
    return words, code


def page_counts(path: Path) -> tuple[int, int]:
    """(prose words, code lines) of a book page (`.md`) or a notebook (`.ipynb`), as a reader
    sees it."""
    if path.suffix != ".ipynb":
        return _markdown_counts(path.read_text(encoding="utf-8"))
    words = code = 0
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        source = "".join(cell["source"])
        tags = set(cell.get("metadata", {}).get("tags", []))
        if tags & HIDDEN_TAGS:
            continue
        if cell["cell_type"] == "markdown":
            w, c = _markdown_counts(source)
            words, code = words + w, code + c
        elif cell["cell_type"] == "code":
            code += sum(1 for ln in source.splitlines()
                        if ln.strip() and not ln.lstrip().startswith(("#|", NBVAL_PREFIX)))
    return words, code


def reading_minutes(path: Path) -> int:
    """Minutes to read a page: its prose at WORDS_PER_MINUTE plus its code at
    CODE_LINES_PER_MINUTE, rounded to 5 minutes."""
    words, code = page_counts(path)
    minutes = words / WORDS_PER_MINUTE + code / CODE_LINES_PER_MINUTE
    return max(5, 5 * round(minutes / 5))


def reading_time_role(name, rawtext, text, lineno, inliner, options=None, content=()):
    """`{reading-time}` `.` (this page) or a path relative to the page -> 'about N minutes'."""
    env = inliner.document.settings.env
    here = Path(env.doc2path(env.docname))
    target = here if text.strip() in ("", ".") else (here.parent / text.strip()).resolve()
    if not target.is_file():
        return _fail(inliner, lineno, rawtext, f"{{reading-time}}`{text}`: no page {target}")
    env.note_dependency(str(target))
    minutes = reading_minutes(target)
    return [nodes.inline(rawtext, f"about {minutes} minutes", classes=["reading-time"])], []


# --- what the site shows -------------------------------------------------------------------------

def repository_buttons(app: Sphinx, config: Config) -> None:
    """Show the repository, issues and launch buttons only when `repository.url` is set."""
    theme = config.html_theme_options
    if theme.get("repository_url"):
        for button in REPO_BUTTONS:
            theme.setdefault(button, True)
        return
    theme.pop("repository_url", None)
    theme.pop("launch_buttons", None)
    for button in REPO_BUTTONS:
        theme[button] = False


def strip_nbval_markers(app: Sphinx, doctree: nodes.document) -> None:
    """Drop `# NBVAL_*` lines from the code cells of notebooks."""
    for block in doctree.findall(nodes.literal_block):
        parent = block.parent
        if parent is None or "cell_input" not in parent.get("classes", []):
            continue
        text = block.astext()
        if NBVAL_PREFIX not in text:
            continue
        kept = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith(NBVAL_PREFIX))
        block.children = [nodes.Text(kept.lstrip("\n"))]
        block.rawsource = kept.lstrip("\n")


def is_thebe_script(filename: str | None, body: str | None) -> bool:
    """sphinx-thebe's scripts: its config (which names a CDN address) and its loader."""
    return (filename or "").endswith("sphinx-thebe.js") or "THEBE_JS_URL" in (body or "")


def tidy_scripts(app: Sphinx, env) -> None:
    """Write each inline script once, and no thebe scripts while thebe is off.

    An extension's `app.add_js_file(None, body=...)` made after the builder started is stored once
    with filename None (on the builder) and again with filename '' (re-read from the registry when
    writing starts); the two compare unequal, so sphinx-thebe's config was written twice on every
    page: `Identifier 'THEBE_JS_URL' has already been declared`. Dropping the None copies leaves
    the registry's. Jupyter Book always loads sphinx-thebe; without a thebe launch button its
    scripts only point at unpkg.com, so they go too.
    """
    thebe_on = bool(app.config.html_theme_options.get("launch_buttons", {}).get("thebe"))
    registry = app.registry.js_files
    if not thebe_on:
        registry[:] = [(f, a) for f, a in registry if not is_thebe_script(f, a.get("body"))]
    js_files = getattr(app.builder, "_js_files", None)
    if js_files is None:
        return
    registered = {(a.get("body"), a.get("priority", 500)) for f, a in registry if not f}
    js_files[:] = [
        js for js in js_files
        if (js.filename is not None or (js.attributes.get("body"), js.priority) not in registered)
        and (thebe_on or not is_thebe_script(js.filename, js.attributes.get("body")))
    ]


def setup(app: Sphinx) -> dict:
    app.add_role("num", num_role)
    app.add_role("reading-time", reading_time_role)
    app.connect("config-inited", repository_buttons)
    app.connect("doctree-read", strip_nbval_markers)
    app.connect("env-purge-doc", purge_num_errors)
    app.connect("env-merge-info", merge_num_errors)
    app.connect("env-updated", fail_on_num_errors)
    app.connect("env-updated", tidy_scripts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
