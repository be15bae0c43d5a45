# `make run` trains the debug model on the default mesh; `make test` runs the suite.
# Both create .venv on first use and install only what is missing.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The torch to install when none is importable. On a CPU-only machine this pin takes
# the local CPU build; override it (e.g. TORCH_SPEC="torch==2.11.0") for other set-ups.
TORCH_SPEC ?= torch==2.13.0
ARGS ?=

.PHONY: run test env clean

$(VENV)/.ready: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -e ".[test]"
	touch $@

env: $(VENV)/.ready

run: env
	$(PY) launch/run.py $(ARGS)

test: env
	$(PY) -m pytest -q tests $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
