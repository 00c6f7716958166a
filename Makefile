# Two commands for a new user: `make demo` (install + train) and `make test` (install + run the tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo solo test test-fast clean

$(BIN)/swarmloco: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

install: $(BIN)/swarmloco

demo: install
	$(BIN)/swarmloco swarm --peers 3 --preset tiny --rounds 5 --workdir runs/demo --summary-json runs/demo/summary.json

solo: install
	$(BIN)/swarmloco peer --solo --preset tiny --max-steps 300 --workdir runs/solo --summary-json runs/solo/summary.json

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q tests/unit

clean:
	rm -rf runs .pytest_cache
