"""The book: it builds with warnings as errors, and the built site renders in a real (headless)
browser."""

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "_build"  # shared with `make book`
HTML = BUILD / "html"
BUILD_LOG = BUILD / "jupyter-book.log"
# The chapter page the browser test opens and photographs, relative to _build/html/.
CHAPTER_PAGE = "notebooks/03_scheduler.html"
SCREENSHOT = BUILD / "screenshots" / "scheduler.png"

# The machine may have no network: these keep Chromium from retrying Google services in a loop.
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
# How myst-nb marks saved error output (checked against a built notebook with an exception and a
# stderr print), plus docutils' inline error boxes.
ERROR_OUTPUT_SELECTOR = ".output.traceback, .output.error, .output.stderr, .system-message"
# A page with display math: MathJax (served with the book, book/_static/mathjax) must typeset it
# offline.
MATH_PAGE = "book/five_ideas.html"
# Addresses of content delivery networks: the site must load nothing from them.
CDN = re.compile(r"(cdn\.jsdelivr\.net|unpkg\.com|cdnjs\.cloudflare\.com|mathjax@)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def simulator_checks() -> list[tuple[str, list[tuple[str, str]], str, str, str]]:
    """In-page simulators (book/_static/sim): page, inputs, output, data key, Python's answer."""
    import torch

    from nanoengine.engine.cuda_graphs import bucket_for, graph_buckets
    from nanoengine.utils.memory import kv_cache_bytes_per_token, plan_kv_pool

    class Qwen3Small:  # Qwen3-0.6B's cache shape, the KV-pool calculator's defaults
        num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim = 28, 16, 8, 128

    bpt = kv_cache_bytes_per_token(Qwen3Small(), 2, tensor_parallel_size=2)
    plan = plan_kv_pool(141 * 2**30, int(1.4 * 2**30), 0, 0.9, bpt, 256, 4096)
    logits = torch.tensor([4.2, 3.6, 3.1, 2.9, 2.5, 2.2, 2.0, 1.8, 1.7, 1.5, 1.2, 1.0, 0.9, 0.6,
                           0.4, 0.2, 0.0, -0.3, -0.8, -2.0], dtype=torch.float64)  # chapter 06's
    probs = ",".join(f"{p:.4f}" for p in torch.softmax(logits / 0.5, -1).tolist())
    kv, temp = "notebooks/00_orientation.html", "notebooks/06_sampler.html"
    buckets = "notebooks/11_cuda_graphs.html"
    return [
        (kv, [("tp", "2")], "#sim-kv-pool-out", "bytesPerToken", str(bpt)),
        (kv, [("gpu_gib", "141")], "#sim-kv-pool-out", "numTokens", str(plan.num_tokens)),
        (buckets, [("max_num_seqs", "100"), ("batch", "97")], "#sim-graph-buckets-out", "bucket",
         str(bucket_for(graph_buckets(100), 97))),
        (temp, [("temperature", "0")], "#sim-temperature-out", "greedy", str(int(logits.argmax()))),
        (temp, [("temperature", "0.5")], "#sim-temperature-out", "probs", probs),
    ]


# The scheduler stepper's page and defaults (notebook 03's markup): pool blocks, block size, budget,
# max_num_seqs.
STEPPER_PAGE = "notebooks/03_scheduler.html"
# Common laptop windows, in CSS pixels: no code or output block may scroll sideways at either.
VIEWPORT_WIDTH = 1280  # the reader's window: every page is opened and checked at this width
WIDE_VIEWPORTS = (1440, VIEWPORT_WIDTH)
# The first line of every visible code block (a cell's code or output, a fenced block) wider than
# its box.
OVERFLOWING_CODE = """() => [...document.querySelectorAll('article pre')]
    .filter(e => e.clientWidth > 0 && e.scrollWidth > e.clientWidth + 1)
    .map(e => e.innerText.split('\\n')[0].slice(0, 60))"""
WIDE_BLOCKS = BUILD / "wide_blocks.json"  # what scrolls, per width and page (the last browser run)
STEPPER_DEFAULTS = (24, 4, 16, 8, [(10, 8), (22, 6), (7, 10), (16, 5)])


def stepper_states(num_blocks: int, block_size: int, budget: int, max_num_seqs: int,
                   requests) -> list[dict]:
    """The Python Scheduler's queues after each step, as the stepper's output shows them (names A,
    B, ...)."""
    from nanoengine.engine.scheduler import Scheduler
    from nanoengine.engine.sequence import Sequence
    from nanoengine.sampling_params import SamplingParams

    sch = Scheduler(num_blocks, block_size, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=budget,
                    max_model_len=1 << 20, enable_prefix_caching=False)
    names = {}
    for i, (prompt, max_tokens) in enumerate(requests):
        seq = Sequence([1000 * (i + 1) + t for t in range(prompt)],
                       SamplingParams(max_tokens=max_tokens),
                       block_size=block_size)
        names[seq.seq_id] = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[i]
        sch.add(seq)
    states = []
    while not sch.is_finished():
        batch = sch.schedule()
        sch.postprocess(batch, [7] * len(batch.seqs))
        states.append({
            "step": str(batch.step), "waiting": "".join(names[s.seq_id] for s in sch.waiting),
            "running": "".join(names[s.seq_id] for s in sch.running),
            "freeBlocks": str(sch.block_manager.num_free_blocks),
            "preemptions": str(sch.num_preemptions),
        })
    return states


def click_stepper(page) -> list[str]:
    """Step, run and reset chapter 03's scheduler stepper; what it shows must be the Python
    Scheduler's state."""
    out = "#sim-scheduler-out"
    if page.locator(out).count() != 1:
        return [f"{STEPPER_PAGE}: no scheduler stepper {out}"]
    problems = []

    def shown() -> dict:
        return page.eval_on_selector(out, "o => Object.assign({text: o.textContent}, o.dataset)")

    def expect(when: str, want: dict) -> None:
        got = shown()
        if any(got.get(k) != v for k, v in want.items()):
            problems.append(f"{STEPPER_PAGE}: {when}, the stepper shows {got}, expected {want}")

    states = stepper_states(*STEPPER_DEFAULTS)
    expect("before any step", {"step": "0", "waiting": "ABCD", "running": ""})
    for k in range(3):
        page.click('.sim-scheduler button[name="step"]')
        expect(f"after {k + 1} clicks on Step", states[k])
    rows = page.locator(".sim-scheduler-history tbody tr").count()
    if rows != 3:
        problems.append(f"{STEPPER_PAGE}: {rows} rows in the stepper's history after 3 steps, "
                        "expected 3")
    page.fill('.sim-scheduler input[name="num_blocks"]', "16")  # a smaller pool: a preemption
    expect("after the pool shrank", {"step": "0", "waiting": "ABCD"})
    page.click('.sim-scheduler button[name="run"]')
    small = stepper_states(16, *STEPPER_DEFAULTS[1:])
    expect("after Run on 16 blocks", {**small[-1], "done": "yes"})
    marked = page.eval_on_selector_all(
        ".sim-scheduler-history tbody td:nth-child(5)",
        "tds => tds.filter(td => td.textContent).length"
    )
    if small[-1]["preemptions"] == "0" or not marked:
        problems.append(f"{STEPPER_PAGE}: the 16-block run shows no preemption in the stepper's "
                        "history")
    page.click('.sim-scheduler button[name="reset"]')
    expect("after Reset", {"step": "0", "waiting": "ABCD", "running": ""})
    return problems


# --- building -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def book_build() -> dict:
    """Build the whole book from scratch into _build/ (as `make book` does), with warnings as
    errors."""
    jupyter_book = Path(sys.executable).parent / "jupyter-book"
    # --all: an incremental build only re-reads changed pages, so it would not repeat an old page's
    # warnings.
    cmd = [str(jupyter_book), "build", str(REPO), "--path-output", str(REPO), "--all", "-W", "-n",
           "--keep-going"]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=1200)
    seconds = time.monotonic() - start
    log = ANSI.sub("", proc.stdout)
    BUILD.mkdir(exist_ok=True)
    BUILD_LOG.write_text(log, encoding="utf-8")
    print(f"jupyter-book build took {seconds:.1f} s; log in {BUILD_LOG}")
    return {"returncode": proc.returncode, "log": log, "seconds": seconds, "cmd": " ".join(cmd)}


@pytest.mark.slow
def test_book_builds_with_warnings_as_errors(book_build):
    if book_build["returncode"] != 0:
        lines = book_build["log"].splitlines()
        warnings = [ln for ln in lines if "WARNING" in ln or "ERROR" in ln]
        others = [ln for ln in lines
                  if ln.strip() and ln not in warnings and not ln.startswith("=====")]
        pytest.fail(
            f"`{book_build['cmd']}` exited with {book_build['returncode']} "
            f"after {book_build['seconds']:.0f} s (full log: {BUILD_LOG}).\n"
            f"{len(warnings)} warnings/errors:\n" + "\n".join(warnings[:60])
            + "\n\nlast other lines of the log:\n" + "\n".join(others[-15:]),
            pytrace=False,
        )


# --- what the built pages contain -----------------------------------------------------------------

def built_pages() -> list[Path]:
    return sorted(HTML.rglob("*.html"))


@pytest.mark.slow
def test_site_loads_nothing_from_a_cdn(book_build):
    found = [f"{p.relative_to(HTML)}: {m.group(0)}" for p in built_pages()
             for m in [CDN.search(p.read_text(encoding="utf-8"))] if m]
    assert not found, ("pages that reference a CDN (an offline reader would miss them):\n"
                       + "\n".join(found))


PRE = re.compile(r"<pre[^>]*>(.*?)</pre>", re.S)


@pytest.mark.slow
def test_site_hides_nbval_markers_in_code(book_build):
    found = [str(p.relative_to(HTML)) for p in built_pages()
             if any("NBVAL_" in block for block in PRE.findall(p.read_text(encoding="utf-8")))]
    assert not found, f"pages whose code shows `# NBVAL_*` test markers: {found}"


# --- what the table of contents promises ----------------------------------------------------------

def toc_files() -> list[str]:
    """Every page of _toc.yml, root first, as paths without suffix relative to the repository."""
    toc = yaml.safe_load((REPO / "_toc.yml").read_text(encoding="utf-8"))
    files = [toc["root"]]

    def walk(entries):
        for entry in entries or []:
            if "file" in entry:
                files.append(entry["file"])
            walk(entry.get("sections"))

    walk(toc.get("chapters"))
    for part in toc.get("parts") or []:
        walk(part.get("chapters"))
    return [re.sub(r"\.(md|ipynb)$", "", f) for f in files]


# Sphinx's smart quotes: what a reader sees for ' and " in a heading.
SMART_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})


def plain(markdown: str) -> str:
    """The text a reader sees for a markdown heading: no links, code ticks or emphasis marks
    (quotes compared as typed: see SMART_QUOTES)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", markdown)
    text = text.replace("`", "").replace("**", "").replace("*", "")
    return " ".join(text.translate(SMART_QUOTES).split())


def page_title(stem: str) -> str:
    """The first `# ` heading of a toc page (a markdown file or a notebook's markdown cells)."""
    for suffix in (".md", ".ipynb"):
        path = REPO / (stem + suffix)
        if not path.exists():
            continue
        if suffix == ".md":
            chunks = [path.read_text(encoding="utf-8")]
        else:
            nb = json.loads(path.read_text(encoding="utf-8"))
            chunks = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]
        for chunk in chunks:
            for line in chunk.splitlines():
                if line.startswith("# "):
                    return plain(line[2:])
        raise AssertionError(f"{path.relative_to(REPO)} has no `# ` title")
    raise AssertionError(f"_toc.yml lists {stem}, but neither {stem}.md nor {stem}.ipynb exists")


# --- the browser test -----------------------------------------------------------------------------

def check_page(page, name: str, titles: list[str], title: str) -> list[str]:
    """What is wrong with the page open in `page`: navigation, its heading, images, error output."""
    problems = []
    nav = page.eval_on_selector_all(".bd-sidebar-primary a", "els => els.map(a => a.textContent)")
    nav = {" ".join(t.translate(SMART_QUOTES).split()) for t in nav}
    missing = [t for t in titles if t not in nav]
    if missing:
        problems.append(f"{name}: the sidebar lacks the chapters {missing} (it has {sorted(nav)})")
    h1 = page.locator("article h1").first.inner_text().replace("#", "").translate(SMART_QUOTES)
    h1 = " ".join(h1.split())
    if h1 != title:
        problems.append(f"{name}: the page heading is {h1!r}, expected {title!r}")
    broken = page.evaluate(
        "() => [...document.images].filter(i => !(i.complete && i.naturalWidth > 0))"
        ".map(i => i.src)"
    )
    if broken:
        problems.append(f"{name}: images that did not load: {broken}")
    # A cell tagged `expected-stderr` shows an error on purpose (14.2: what a failing worker
    # prints).
    errors = page.eval_on_selector_all(
        ERROR_OUTPUT_SELECTOR,
        "els => els.filter(e => !e.closest('.tag_expected-stderr')).map(e => e.innerText)",
    )
    for text in errors:
        problems.append(f"{name}: error output on the page: {text[:300]!r}")
    shown = page.evaluate(
        "() => { const b = document.body.cloneNode(true);"
        " b.querySelectorAll('.tag_expected-stderr').forEach(e => e.remove());"
        " return b.textContent; }"
    )
    if "Traceback" in shown:
        problems.append(f"{name}: the page shows a Traceback")
    return problems


@pytest.mark.slow
def test_site_renders_in_headless_chromium(book_build):
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed; `bash tests/browser_setup.sh` installs it")
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    index, chapter = HTML / "index.html", HTML / CHAPTER_PAGE
    assert index.exists(), f"the book build wrote no {index}"
    assert chapter.exists(), (f"the book build wrote no {chapter}; update CHAPTER_PAGE in "
                              f"{Path(__file__).name}")
    stems = toc_files()
    titles = [page_title(s) for s in stems]
    root_html = stems[0] + ".html"
    chapter_title = page_title(CHAPTER_PAGE.removesuffix(".html"))

    problems, js_errors, remote_failures = [], [], []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": VIEWPORT_WIDTH, "height": 900})
            page.on("pageerror", lambda err: js_errors.append(str(err)))

            def request_failed(request):
                if request.url.startswith("file:"):  # a missing file of the site itself
                    problems.append(f"could not load {request.url}: {request.failure}")
                else:  # nothing should be remote; reported, not fatal (the CDN test fails)
                    remote_failures.append(request.url)

            page.on("requestfailed", request_failed)

            page.goto(index.as_uri(), wait_until="load")
            # index.html redirects to the root page
            page.wait_for_url(f"**/{root_html}", timeout=15_000)
            page.wait_for_load_state("load")
            problems += check_page(page, "index", titles, titles[0])

            page.goto(chapter.as_uri(), wait_until="load")
            problems += check_page(page, CHAPTER_PAGE, titles, chapter_title)
            if page.locator("article.bd-article img").count() == 0:
                problems.append(f"{CHAPTER_PAGE}: no figure in the chapter")
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)

            clicked = set()
            for sim_page, fills, output, key, expected in simulator_checks():
                if sim_page not in clicked:
                    page.goto((HTML / sim_page).as_uri(), wait_until="load")
                    clicked.add(sim_page)
                if page.locator(output).count() != 1:
                    problems.append(f"{sim_page}: no simulator output {output}")
                    continue
                for name, value in fills:
                    page.fill(f'.sim input[name="{name}"]', value)
                try:
                    page.wait_for_function(
                        "([sel, key, want]) => document.querySelector(sel).dataset[key] === want",
                        arg=[output, key, expected], timeout=5_000,
                    )
                except PlaywrightTimeout:
                    shown = page.eval_on_selector(
                        output, "o => JSON.stringify(o.dataset) + ' ' + o.textContent"
                    )
                    problems.append(
                        f"{sim_page}: after {fills} the simulator shows {shown}, "
                        f"expected {key}={expected}"
                    )
            print(f"simulators clicked on {len(clicked)} pages")
            page.goto((HTML / STEPPER_PAGE).as_uri(), wait_until="load")
            problems += click_stepper(page)

            wide_blocks = {width: {} for width in WIDE_VIEWPORTS}

            def overflowing(view, width: int, stem: str) -> None:
                """Code is written to 100 columns; code.css makes it fit at `width` px."""
                over = view.evaluate(OVERFLOWING_CODE)
                if over:
                    wide_blocks[width][stem] = over
                    problems.append(f"{stem}: {len(over)} code or output blocks scroll "
                                    f"sideways at {width} px, the first: {over[0]!r}")

            for stem in stems:  # every page of the table of contents, as a reader opens it
                page.goto((HTML / f"{stem}.html").as_uri(), wait_until="load")
                overflowing(page, VIEWPORT_WIDTH, stem)
                if stem == stems[0]:  # checked above, after the redirect from index.html
                    continue
                problems += check_page(page, stem, titles, page_title(stem))
                num_math = page.locator("article span.math, article div.math").count()
                if num_math:
                    try:
                        page.wait_for_function(
                            "n => document.querySelectorAll('article mjx-container').length >= n",
                            arg=num_math, timeout=15_000,
                        )
                    except PlaywrightTimeout:
                        problems.append(f"{stem}: MathJax left raw TeX in {num_math} formulas")
            print(f"every page opened: {len(stems)}")

            for width in WIDE_VIEWPORTS:
                if width != VIEWPORT_WIDTH:  # the reader's pass above measured its own width
                    wide = browser.new_page(viewport={"width": width, "height": 900})
                    for stem in stems:
                        wide.goto((HTML / f"{stem}.html").as_uri(), wait_until="load")
                        overflowing(wide, width, stem)
                    wide.close()
                count = sum(map(len, wide_blocks[width].values()))
                print(f"at {width} px, {count} blocks scroll sideways on "
                      f"{len(wide_blocks[width])} pages")
            WIDE_BLOCKS.write_text(json.dumps(wide_blocks, indent=1), encoding="utf-8")

            page.goto((HTML / MATH_PAGE).as_uri(), wait_until="load")
            try:
                page.wait_for_selector("mjx-container", timeout=15_000)
            except PlaywrightTimeout:
                problems.append(f"{MATH_PAGE}: MathJax typeset no formula (a reader sees raw TeX)")
        finally:
            browser.close()

    problems += [f"JavaScript error: {e}" for e in js_errors]
    print(f"screenshot: {SCREENSHOT}")
    if remote_failures:
        print("remote assets that did not load (offline?):", *sorted(set(remote_failures)),
              sep="\n  ")
    assert not problems, "the built site does not render properly:\n" + "\n".join(problems)


# --- the GPU cells' footers -----------------------------------------------------------------------


def test_gpu_cells_footers_are_short_and_the_long_ones_are_rewritten(tmp_path):
    """scripts/keep_gpu_outputs.py writes a short footer, and --shorten-footers rewrites the
    134-character footers of earlier runs in place, leaving everything else in the notebook as it
    was."""
    import nbformat

    sys.path.insert(0, str(REPO / "scripts"))
    import keep_gpu_outputs

    prov = {
        "gpu": "NVIDIA H200",
        "torch": "2.11.0+cu130",
        "flash_attn": "2.8.3.post2",
        "commit": "f86ab4c" + "0" * 33,
        "date": "2026-12-03T12:00:00+00:00",
    }
    short = keep_gpu_outputs.provenance_line(prov)
    assert short == "[H200 output · how it was measured: appendix]\n" and len(short) < 80
    long = (
        "[output of this cell on an NVIDIA H200 (torch 2.11.0+cu130, flash-attn 2.8.3.post2), "
        "commit f86ab4c, "
        "2026-12-03: scripts/gpu_check.py]\n"
    )
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("A footer in prose stays: [output of this cell on an H200]"),
        nbformat.v4.new_code_cell(
            "# NBVAL_SKIP\nprint(1)",
            outputs=[
                nbformat.v4.new_output("stream", name="stdout", text="1\n"),
                nbformat.v4.new_output("stream", name="stdout", text=long),
            ],
        ),
        nbformat.v4.new_code_cell(
            "# NBVAL_SKIP\nprint(2)",
            outputs=[
                nbformat.v4.new_output("stream", name="stdout", text="2\n" + long + "after\n")
            ],
        ),
    ]
    path = tmp_path / "gpu.ipynb"
    nbformat.write(nb, path)
    before = path.read_text(encoding="utf-8")
    assert keep_gpu_outputs.shorten_footers(path) == 2
    after = nbformat.read(path, as_version=4)
    assert after.cells[1].outputs[1].text == short
    assert after.cells[2].outputs[0].text == "2\n" + short + "after\n"
    assert after.cells[0].source == nb.cells[0].source
    assert path.read_text(encoding="utf-8") == before.replace(long.rstrip("\n"), short.rstrip("\n"))
    assert keep_gpu_outputs.shorten_footers(path) == 0  # idempotent
