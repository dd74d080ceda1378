# Every target installs what it needs into ./.venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test lint docs demo bench clean

$(STAMP): setup.cfg setup.py pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,examples,docs]'
	touch $(STAMP)

install: $(STAMP)

# Lint first (ruff check and format, the wing rules), then the documentation site (strict),
# then the suite on two workers
# (pytest-xdist; many tests wait on child processes and servers; a worker that runs out
# takes half of the other's queue, so no long test is left for the end alone: worksteal).
# CI runs exactly this.
test: lint docs
	$(BIN)/python -m pytest -q -n 2 --dist worksteal tests

# The main job: train, SIGKILL mid-run, resume from the config flag, serve, and
# check the final params equal an uninterrupted run's bit for bit.
demo: $(STAMP)
	$(BIN)/python examples/main_job.py

# The documentation site (Sphinx + MyST, docs/conf.py) into docs/_build/html. Strict: a
# warning (a broken link or reference, a docstring that does not render) fails it.
docs: $(STAMP)
	$(BIN)/python -m sphinx -b html -W --keep-going -n -q docs docs/_build/html

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
	$(BIN)/python tools/import_graph.py --check > /dev/null

clean:
	rm -rf $(VENV) runs docs/_build
