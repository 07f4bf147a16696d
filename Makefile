# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv (Python >= 3.12) first.
PYTHON ?= $(shell for p in python3.13 python3.12 $$(ls -d $$(pyenv root 2>/dev/null)/versions/3.1[2-9]*/bin/python 2>/dev/null | sort -V | tail -1); do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { command -v $$p; break; }; done)
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench venv clean compile

$(BIN)/tether: pyproject.toml
	@test -n "$(PYTHON)" || { echo "tether needs Python >= 3.12 (set PYTHON=/path/to/python3.12)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@touch $@

venv: $(BIN)/tether

# Byte-compiled once, so that every process tether starts (sidecars, control planes, tests' subprocesses) reads
# .pyc files even where PYTHONDONTWRITEBYTECODE is set (an editable install writes none otherwise).
compile: venv
	@$(BIN)/python -m compileall -q tether tests bench >/dev/null

demo: venv compile
	$(BIN)/tether demo

lint: venv
	$(BIN)/ruff check .

# Three workers, a test file to each at a time (a module's fixtures stay in one process): the suite spends most of
# its time waiting on the sidecars, control planes and servers it starts, so it runs in half the time on 2 cores.
# -rs: the summary at the end lists every skipped test with its reason (a missing package, no root ...).
test: venv lint compile
	$(BIN)/pytest -q -p no:cacheprovider -n 3 --dist loadfile -rs

bench: venv
	$(BIN)/python bench/bench_chain.py; $(BIN)/python bench/bench_sidecar.py; \
	$(BIN)/python bench/bench_termination.py; $(BIN)/python bench/bench_fleet.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# The console's screenshots in docs/console/, refreshed on purpose: the browser tests write theirs there instead of
# a temporary directory (a test run never changes the tree).
.PHONY: screenshots
screenshots: venv compile
	TETHER_SCREENSHOTS=$(CURDIR)/docs/console $(BIN)/pytest -q -p no:cacheprovider tests/test_console.py \
		tests/test_console_layout.py tests/test_approval_bodies.py -k "browser or fits or redacted"
