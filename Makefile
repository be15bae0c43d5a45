# `make run` trains the debug model on the default mesh; `make test` runs the suite.
# Both create .venv on first use and install only what is missing.
# `make test-matrix` runs the combination matrix (every pair of settings' values, each row a --parity run).
# `make test-slow` runs the long drills the main suite leaves out (multi-node faults, planner searches).
# `make test-docs` runs every command the README and docs/ show, as typed (in two lanes).
# `make test-compat TORCH_SPEC=torch==2.11.0` runs the parity and combination subset
# on another torch, in an environment of its own (see README, "Torch versions").

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The torch to install when none is importable. On a CPU-only machine this pin takes
# the local CPU build; override it (e.g. TORCH_SPEC="torch==2.11.0") for other set-ups.
TORCH_SPEC ?= torch==2.13.0
ARGS ?=
# Each suite ends with its slowest tests, so that a CI log says where its minutes went.
SLOWEST ?= 12
# Environments for other torch versions live outside the checkout, one per version,
# so a new clone (or CI run) on the same machine reuses the multi-GB download.
COMPAT_ROOT ?= $(HOME)/.cache/meshtrain
COMPAT_VENV := $(COMPAT_ROOT)/$(subst ==,-,$(subst $() ,,$(TORCH_SPEC)))
# The project's own requirements from setup.cfg, without torch (TORCH_SPEC gives it) but
# with torchao, which the float8 rows need.
REQUIREMENTS = $(shell $(PYTHON) -c "import configparser, re, shlex; c = configparser.ConfigParser(); c.read('setup.cfg'); \
	print(' '.join(shlex.quote(r) for r in (c['options']['install_requires'] + c['options.extras_require']['test'] \
	+ c['options.extras_require']['data']).split() \
	if re.match(r'torch\b(?!ao)', r) is None))")

.PHONY: run test test-matrix test-slow test-docs env clean compat-env test-compat

$(VENV)/.ready: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -e ".[test,data]"
	touch $@

env: $(VENV)/.ready

run: env
	$(PY) launch/run.py $(ARGS)

test: env
	$(PY) -m pytest -q --durations=$(SLOWEST) tests $(ARGS)

$(COMPAT_VENV)/.ready: setup.cfg Makefile
	test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)" $(REQUIREMENTS)
	touch $@

test-matrix: env
	$(PY) -m pytest -q --durations=$(SLOWEST) -m matrix tests $(ARGS)

test-slow: env
	$(PY) -m pytest -q --durations=$(SLOWEST) -m slow tests $(ARGS)

# Two lanes side by side, each in its own scratch checkout: the blocks DOCS_LANE selects
# (a -k over the tests' ids, "docs/planning.md:10" for a document's block 10) in one, the
# rest in the other. A block uses only what earlier blocks of its own document made, so
# a document is split between lanes only where its blocks read nothing of each other's
# (docs/planning.md's each write their own report). Most blocks run one process, so two
# lanes keep both cores busy. Each lane prints its slowest blocks, to move one between
# lanes when a lane runs longer. The second lane prints as it goes, the first when it is
# done. With ARGS (a -k of your own, say) one pytest runs what they select; with
# LANE=first or LANE=rest, one lane alone. .ci/run runs the blocks its CI_DOCS_FIRST and
# CI_DOCS_SECOND name.
DOCS_LANE := (planning and not planning.md:10] and not planning.md:2]) or README
LANE ?=
test-docs: env
ifneq ($(strip $(ARGS)),)
	$(PY) -m pytest -q -m docs tests/test_docs_commands.py $(ARGS)
else ifeq ($(LANE),first)
	$(PY) -m pytest -q -m docs tests/test_docs_commands.py -k "$(DOCS_LANE)" --durations=8
else ifeq ($(LANE),rest)
	$(PY) -m pytest -q -m docs tests/test_docs_commands.py -k "not ($(DOCS_LANE))" --durations=8
else ifneq ($(strip $(LANE)),)
	$(error LANE=$(LANE): give LANE=first (the blocks "$(DOCS_LANE)" selects) or LANE=rest, or no LANE for both side by side)
else
	@log=$$(mktemp); \
	$(PY) -m pytest -q -m docs tests/test_docs_commands.py -k "$(DOCS_LANE)" --durations=8 > $$log 2>&1 & lane=$$!; \
	$(PY) -m pytest -q -m docs tests/test_docs_commands.py -k "not ($(DOCS_LANE))" --durations=8; rest=$$?; \
	wait $$lane; first=$$?; \
	echo "== $(DOCS_LANE) (the first lane)"; cat $$log; rm -f $$log; \
	[ $$first -eq 0 ] || exit $$first; exit $$rest
endif

compat-env: $(COMPAT_VENV)/.ready

test-compat: compat-env
	$(COMPAT_VENV)/bin/python -m pytest -q --durations=$(SLOWEST) -m compat tests $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
