# Set-up and checks. Each target makes its own virtual environment (.venv) and installs what it needs.
# TORCH pins the CPU wheel this project is developed with; override it for another build, e.g.
#   make test TORCH='torch==2.5.1'
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench lint clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)  ## record a real NaN crash and show where it came from
	$(PY) examples/nan_smooth_relu.py --out runs/nan_smooth_relu.zarr

test: $(STAMP)  ## the whole suite, slow tests included (what CI runs)
	$(PY) -m pytest -q

test-fast: $(STAMP)  ## the suite without slow tests
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)  ## recording overhead against a baseline, written to docs/PERFORMANCE.md
	$(PY) bench/record_overhead.py --write-docs

lint: $(STAMP)
	$(PY) -m pip install --quiet ruff
	$(VENV)/bin/ruff check recorder replayer tui tests examples bench

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
