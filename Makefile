# Two commands for a new user: `make demo` (install + train) and `make test` (install + run the tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo solo test test-fast bench-smoke chaos-smoke clean

$(BIN)/swarmloco: pyproject.toml
	@echo "installing swarmloco and its dependencies (torch, hivemind, ...) into $(VENV)/: about 3 minutes the first time"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --progress-bar off -e '.[test]'
	touch $@
	@echo "installed: run $(BIN)/swarmloco, or 'source $(VENV)/bin/activate' to have swarmloco on your PATH"

install: $(BIN)/swarmloco

demo: install
	$(BIN)/swarmloco swarm --peers 3 --preset tiny --rounds 5 --workdir runs/demo --summary-json runs/demo/summary.json

solo: install
	$(BIN)/swarmloco peer --solo --preset tiny --max-steps 300 --workdir runs/solo --summary-json runs/solo/summary.json

# Three test processes on two cores: most integration tests spend part of their time waiting (on timeouts, exits,
# sleeping slowdowns), and the other processes' tests fill those gaps. Measured on 2 cores: the CPUs were 85% busy
# with two (749 s) and 93-96% with three (624-683 s), at about the same CPU-seconds.
# --dist worksteal: a worker that runs out of tests takes queued ones from the other (with the default, tests are
# dealt out in turn up front, and one worker could be left with the long tail of real-swarm tests alone).
TEST_WORKERS ?= 3

test: install
	@echo "the whole suite, short chaos runs included, $(TEST_WORKERS) tests at a time: about 11 minutes on 2 cores (make test-fast: the unit tier, about 50 seconds)"
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal

test-fast: install
	$(BIN)/python -m pytest -q tests/unit

bench-smoke: install
	@echo "every benchmark once at its smallest size: about 3 minutes on 2 cores"
	$(BIN)/python -m pytest -q -m bench_smoke tests/integration/test_bench_quick.py

chaos-smoke: install
	@echo "short chaos runs (churn, burners, SIGSTOP of a leader, a staller, silent claimants, a partition as root), also in make test: about 5 minutes"
	$(BIN)/python -m pytest -q -m chaos tests/integration/test_chaos.py

clean:
	rm -rf runs .pytest_cache
