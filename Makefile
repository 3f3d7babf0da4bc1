# The two entry points the README documents.
VENV ?= .venv

.PHONY: setup test check-sm70 lint bench

setup:
	bash scripts/setup_env.sh

# Sets everything up (first run: a few minutes), then runs the test suite.
test: setup
	$(VENV)/bin/python -m pytest -q

check-sm70: setup
	$(VENV)/bin/python scripts/check_sm70.py --packages .cache/nvrtc12

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: setup
	$(VENV)/bin/python benchmarks/kernel_table.py
