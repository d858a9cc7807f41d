# The two commands a user needs first: `make run` and `make test`. Both build .venv from nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test test-slow lint format clean

setup: $(STAMP)

# torch==2.13.0 first: it is the CPU wheel on local disk; a looser pin could pull a CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

run: $(STAMP)
	$(PY) examples/quickstart.py

test: $(STAMP)
	$(PY) -m pytest -q -x -p no:cacheprovider

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check tpu_inductor lowering passes tests examples
	$(VENV)/bin/ruff format --check tpu_inductor lowering passes tests examples

format: $(STAMP)
	$(VENV)/bin/ruff format tpu_inductor lowering passes tests examples
	$(VENV)/bin/ruff check --fix tpu_inductor lowering passes tests examples

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
