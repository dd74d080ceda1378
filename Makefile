# Every target installs what it needs into ./.venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test lint demo bench clean

$(STAMP): setup.cfg setup.py pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,examples]'
	touch $(STAMP)

install: $(STAMP)

# Lint first (ruff check and format, the wing rules), then the suite on two workers
# (pytest-xdist; many tests wait on child processes and servers; a worker that runs out
# takes half of the other's queue, so no long test is left for the end alone: worksteal).
# CI runs exactly this.
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist worksteal tests

# The main job: train, SIGKILL mid-run, resume from the config flag, serve, and
# check the final params equal an uninterrupted run's bit for bit.
demo: $(STAMP)
	$(BIN)/python examples/main_job.py

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
	$(BIN)/python tools/import_graph.py --check > /dev/null

clean:
	rm -rf $(VENV) runs
