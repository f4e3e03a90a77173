# Two entry points: `make demo` (simulated federation on built-in data) and `make test`.
# Both create .venv on first use. torch is installed first and pinned, so no resolver
# ever replaces the local CPU build with a multi-GB CUDA one.
VENV ?= .venv
PYTHON ?= python3
TORCH ?= torch==2.13.0
BIN = $(VENV)/bin

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

demo: setup
	$(BIN)/dadfl sim

# One worker per core (a third worker on 2 cores cost more CPU than it saved waiting); tests go
# to whichever worker is free, in collection order (xdist's own order puts the largest groups
# first), except those sharing a module- or class-scoped fixture, which stay on one worker
# (tests/conftest.py marks them, and puts the slow tests' files first).
TEST_WORKERS ?= auto
test: setup
	FLWR_TELEMETRY_ENABLED=0 $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

bench: setup
	$(BIN)/python -m bench.run

clean:
	rm -rf $(VENV) runs
