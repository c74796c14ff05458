# The README's quick start: `make demo` (set up + decode a story) and `make test` (set up + run the tests).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install -q -e '.[test]'
	touch $@

.PHONY: demo test bench
demo: $(VENV)/.base
	$(PY) run_decode.py

test: $(VENV)/.test
	$(PY) -m pytest -q tests

bench: $(VENV)/.test
	$(PY) -m experiments.bench_ar
