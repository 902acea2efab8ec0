"""Sphinx extension for the nanoengine book: what a reader should and should not see on the site."""

from __future__ import annotations

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.config import Config

NBVAL_PREFIX = "# NBVAL_"  # test-runner markers (nbval): they mean nothing to a reader
REPO_BUTTONS = ("use_repository_button", "use_issues_button")


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

    An extension's `app.add_js_file(None, body=...)` made after the builder started is stored once with
    filename None (on the builder) and again with filename '' (re-read from the registry when writing
    starts); the two compare unequal, so sphinx-thebe's config was written twice on every page:
    `Identifier 'THEBE_JS_URL' has already been declared`. Dropping the None copies leaves the
    registry's. Jupyter Book always loads sphinx-thebe; without a thebe launch button its scripts only
    point at unpkg.com, so they go too.
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
    app.connect("config-inited", repository_buttons)
    app.connect("doctree-read", strip_nbval_markers)
    app.connect("env-updated", tidy_scripts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
