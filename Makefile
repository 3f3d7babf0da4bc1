# The two entry points the README documents.
VENV ?= .venv

.PHONY: setup setup-serve serve test test-fast check-sm70 check-archs lint bench

# The edit-test loop (under 5 minutes on 2 cores): the kernels against their references (the CUDA simulator
# included) and the key-band tests, parity with Cloudflare's reference, encoding and answers, the server's contract.
FAST_TESTS = tests/test_conv1d.py tests/test_gated_delta_rule.py tests/test_paged_attention.py tests/test_glue.py \
	tests/test_key_band.py tests/test_parity.py tests/test_encoding.py tests/test_answers.py tests/test_intake.py \
	tests/test_server.py

# The tests' set-up: their dependencies, oracles and tools (scripts/setup_env.sh says which).
setup:
	bash scripts/setup_env.sh test

# The server's alone: the torch for this machine's GPU, the kernels built for it, no test tooling.
setup-serve:
	bash scripts/setup_env.sh serve

# Sets the server up (first run: a few minutes), then serves on :8080. ARGS passes flags to clef-serve,
# e.g. make serve ARGS="--w /mnt/models/clef-flash --d 0 --dtype f16". No --w: the embedded default model.
serve: setup-serve
	$(VENV)/bin/clef-serve $(ARGS)

# Sets everything up (first run: a few minutes), then runs the test suite: two pytest-xdist workers, each with
# its share of the cores (tests/conftest.py), tests handed out one at a time and stolen when a worker runs dry.
TEST_WORKERS ?= 2
test: setup
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal

test-fast: setup
	$(VENV)/bin/python -m pytest -q $(FAST_TESTS)

# Every kernel compiled for sm_60 ... sm_120 with CUDA 12.9's NVRTC: registers, spills, barriers, shared memory, tiles.
check-archs: setup
	$(VENV)/bin/python scripts/check_archs.py --packages .cache/nvrtc12

check-sm70: setup
	$(VENV)/bin/python scripts/check_archs.py --packages .cache/nvrtc12 --arch sm_70

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: setup
	$(VENV)/bin/python benchmarks/kernel_table.py
