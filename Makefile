# Two entry points: `make run` (the main job) and `make test` (lint + the whole suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/accelfn: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(BIN)/accelfn

setup: $(BIN)/accelfn

run: setup
	$(BIN)/python examples/classify_digits.py

test: setup
	$(BIN)/ruff check accelfn tests benchmarks examples docs
	$(BIN)/python -m mypy
	$(BIN)/python -m mypy examples
	$(BIN)/python -m pytest -q

# The site in site/; its API reference is generated from the docstrings (mkdocstrings).
docs: setup
	$(BIN)/mkdocs build --strict

.PHONY: setup run test docs
