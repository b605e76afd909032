# Set-up and checks. Each target makes its own virtual environment (.venv) and installs what it needs.
# TORCH pins the CPU wheel this project is developed with; override it for another build, e.g.
#   make test TORCH='torch==2.5.1'
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast browser bench screenshots lint clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)  ## record a real NaN crash and show where it came from
	$(PY) examples/nan_smooth_relu.py --out runs/nan_smooth_relu.zarr

# Tests run in parallel (pytest-xdist), one worker per core up to PYTEST_WORKERS; each test's files are its own.
# --dist worksteal: a worker that runs out of tests takes queued ones from another (no long tail of one worker).
PYTEST_WORKERS ?= 4
PYTEST := $(PY) -m pytest -q -n auto --maxprocesses=$(PYTEST_WORKERS) --dist worksteal

test: $(STAMP) browser  ## the whole suite, slow tests included (what CI runs)
	$(PYTEST)

test-fast: $(STAMP)  ## the suite without slow tests
	$(PYTEST) -m "not slow"

# Debian's chromium and chromedriver, for the browser test of `pdbg serve` (skipped, and said so, without them).
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  if command -v apt-get >/dev/null; then \
	    SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo -n); \
	    $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium chromium-driver \
	      || echo "make: could not install chromium; the browser test of pdbg serve will be skipped"; \
	  else echo "make: no apt-get here; install chromium and chromedriver for the browser test of pdbg serve"; fi; \
	fi

bench: $(STAMP)  ## recording overhead against a baseline, written to docs/PERFORMANCE.md
	$(PY) bench/record_overhead.py --write-docs

screenshots: $(STAMP)  ## the README's tour pictures (docs/images), from the demo's recording
	@[ -d runs/nan_smooth_relu.zarr ] || $(MAKE) demo
	$(PY) docs/tour_screenshots.py

lint: $(STAMP)
	$(PY) -m pip install --quiet ruff
	$(VENV)/bin/ruff check recorder replayer tui tests examples bench docs

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
