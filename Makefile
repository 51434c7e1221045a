# Entry points: `make run` (the main job), `make test` (lint, types and the whole suite: what CI
# runs) and `make test-fast` (lint and the tests not marked slow, compile or distributed: for
# day-to-day work). Every test process, and every process a test starts, runs torch with one
# intra-op thread (tests/conftest.py sets it; the variables below cover what starts before it).
#
# `make run` installs what the example needs and nothing more: accelfn with the `plot` extra
# (matplotlib, for its run.png), not the test extra's peers, trackers and checkers (lightning,
# accelerate, wandb, mlflow, mypy, ...), which `make setup` and every test target install. The
# example picks its own torch thread count, within the free cores (accelfn's own verdict).
#
# The tests run in parallel: pytest-xdist starts WORKERS pytest processes (`auto`: one per
# physical core, so 2 on a 2-core machine), each running one test at a time with one
# intra-op thread; a test that launches torchrun still adds its own processes beside them.
# Tests sharing a module-scoped fixture stay on one worker (tests/conftest.py), so each
# such fixture is built once. `make test WORKERS=0` runs everything in this one process.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
WORKERS ?= auto
PYTEST := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(BIN)/python -m pytest -n $(WORKERS) \
	--dist loadgroup
FAST := not slow and not compile and not distributed

# stamps: what each install gave this venv (the test extra holds the plot extra too)
RUN_DEPS := $(VENV)/.installed-run
TEST_DEPS := $(VENV)/.installed-test

$(TEST_DEPS): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(BIN)/accelfn $(RUN_DEPS) $(TEST_DEPS)

$(RUN_DEPS): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[plot]'
	touch $(RUN_DEPS)

setup: $(TEST_DEPS)

run: $(RUN_DEPS)
	$(BIN)/python examples/classify_digits.py

lint: setup
	$(BIN)/ruff check accelfn tests benchmarks examples docs

test: lint
	$(BIN)/python -m mypy
	$(BIN)/python -m mypy examples
	$(PYTEST) -q

test-fast: lint
	$(PYTEST) -q -m "$(FAST)"

# The full dry run of benchmarks/gpu_suite.sh on the CPU (every part, tiny: minutes); `make
# test` runs a cheap part of it.
test-gpu-suite: setup
	$(PYTEST) -q --gpu-suite-dry-run -m gpu_suite tests/cli/test_bench.py

# The site in site/; its API reference is generated from the docstrings (mkdocstrings).
docs: setup
	$(BIN)/mkdocs build --strict

.PHONY: setup run lint test test-fast test-gpu-suite docs
