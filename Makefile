# The two commands a user needs first: `make run` and `make test`. Both build .venv from nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test test-slow opinfo bench mutation lint format docs clean

setup: $(STAMP)

# torch==2.13.0 first: it is the CPU wheel on local disk; a looser pin could pull a CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,torch-mlir]"
	touch $(STAMP)

run: $(STAMP)
	$(PY) examples/quickstart.py

# Two workers (pytest-xdist): the suite is compile-bound and CI has 2 cores.
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n 2

# The full OpInfo run (3 samples; float32, bfloat16, int64, bool) → bench/results/opinfo.md.
opinfo: $(STAMP)
	mkdir -p bench/results
	$(PY) -m tests.opinfo.runner --samples 3 --out bench/results/opinfo.md \
		--json bench/results/opinfo.json

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# The standard benchmark set (inference and training step) → bench/results/latest.{json,md,png}.
$(VENV)/.installed-bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	touch $@

bench: $(VENV)/.installed-bench
	$(PY) -m tpu_inductor.cli bench --train --json bench/results/latest.json \
		--markdown bench/results/latest.md --plot bench/results/latest.png

# Mutation testing of the lowering rules (tools/mutation): a sample of each rule file's mutants
# against the tests that execute them, time-boxed; report → bench/results/mutation.md. Minutes.
mutation: $(STAMP)
	$(PY) -m tools.mutation --sample 20 --time-box 300 --out bench/results/mutation.md \
		--json bench/results/mutation.json

# The user guide (MkDocs, Material, mkdocstrings: the API page from the docstrings) → site/.
# --strict: a broken link, a missing reference or a docstring warning fails the build.
$(VENV)/.installed-docs: $(STAMP)
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(VENV)/bin/ruff check tpu_inductor lowering passes tests examples
	$(VENV)/bin/ruff format --check tpu_inductor lowering passes tests examples

format: $(STAMP)
	$(VENV)/bin/ruff format tpu_inductor lowering passes tests examples
	$(VENV)/bin/ruff check --fix tpu_inductor lowering passes tests examples

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
