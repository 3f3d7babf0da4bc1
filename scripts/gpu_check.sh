#!/usr/bin/env bash
# The GPU check: one command for a lent GPU machine, in two stages, each with its own budget and verdict, so
# that a 10-minute window always ends with a verdict and as many tables as fit.
#
#   1. The gate (GATE_BUDGET, default 420 s; about 7 minutes on an H200, racecheck 4 of them): build for the
#      local arch only; every op test's CUDA cases (-m cuda: conv, delta rule, paged attention v1, v2 with
#      forced splits and the combine, SIMT, the glue ops in place too, int8 dequantize; the server's start-up
#      behind its kernel trials) with CUDA_LAUNCH_BLOCKING=1, so a fault is raised by the op that caused it;
#      compute-sanitizer's memcheck, racecheck, synccheck and initcheck on every kernel once
#      (scripts/gpu_sanitize_cases.py); the self-check at clef-flash's shapes in f16, bf16 (sm_80+) and with
#      int8 weights; the shadow tolerance in f16 and bf16, gating. Each step has a time limit: one that runs
#      out fails the gate ("TIMEOUT").
#   2. The tables (until TOTAL_BUDGET, default 560 s, from the start): the delta rule at clef-flash's shape
#      (chunked, serial and FLA by device time under CUDA graphs, 2k / 8k / 16k tokens) and one 2,048-token
#      decision at clef-flash's shapes (random weights, f16 and int8) split by op; the ops; attention v1 / v2 /
#      SIMT / SDPA at 2k and 16k of context with one trunk step split by op; int8 dequantize + GEMM against f16
#      at 64, 256, 1,024 and 4,096 rows; the start-up autotune at clef-flash's shapes; then the whole suite while
#      time remains. A table that does not fit the time left is skipped, saying so.
#
# Files under $OUT (at most 8): verdict.txt, gate.log, delta_rule.md, ops.md, attention.md, int8.md, autotune.md,
# suite.log. The exit status is the gate's.
#
#   bash scripts/gpu_check.sh --tables-only   (the build, then the tables alone: a second call after the gate)
#
# The device machine has no network and its own Python (scripts/gpu_image_packages.txt lists what it has).
# Prepare what it lacks here, as wheels that travel with the tree (the device tool's README, "Notes"):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl -r scripts/gpu_check_requirements.txt
#   python3 -m pip download --no-deps -d .whl clef-finetune==0.1.0 && pip install --no-deps --target .oracles/fla fla-core==0.6.0
# then run, through the device tool, with carry [".whl", ".oracles"]:
#   bash scripts/gpu_check.sh
# and commit the tables to benchmarks/RESULTS.md with the date and device.
#
#   bash scripts/gpu_check.sh --dry-run   (CI, no GPU: installs nothing; scripts/gpu_check_dry_run.py says what)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "--dry-run" ]; then  # in the development environment (it maps modules through its metadata)
  bash -n "$0" || exit 1
  [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
  exec "$PY" scripts/gpu_check_dry_run.py
fi

tables_only=0
if [ "${1:-}" = "--tables-only" ]; then tables_only=1; fi

OUT=${OUT:-.cache/gpu_check}
mkdir -p "$OUT"
GATE_BUDGET=${GATE_BUDGET:-420}
TOTAL_BUDGET=${TOTAL_BUDGET:-560}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
: > "$OUT/verdict.txt"
: > "$OUT/gate.log"
gate_failed=0

# gate NAME SECONDS CMD...: one gate step, its output appended to gate.log, its verdict to verdict.txt.
gate() {
  local name=$1 limit=$2 started status
  shift 2
  started=$(date +%s)
  echo "=== $name ($(elapsed) s)" | tee -a "$OUT/gate.log"
  timeout "$limit" "$@" >> "$OUT/gate.log" 2>&1
  status=$?
  local took=$(( $(date +%s) - started ))
  if [ "$status" = 0 ]; then
    echo "PASS    $name (${took} s)" | tee -a "$OUT/verdict.txt"
  elif [ "$status" = 124 ]; then
    echo "TIMEOUT $name (over its ${limit} s)" | tee -a "$OUT/verdict.txt"
    gate_failed=1
  else
    echo "FAIL    $name (exit $status, ${took} s; see gate.log)" | tee -a "$OUT/verdict.txt"
    gate_failed=1
  fi
  tail -3 "$OUT/gate.log"
}

# table NAME SECONDS FILE CMD...: one stage-2 table into FILE, when the time left allows SECONDS.
table() {
  local name=$1 limit=$2 file=$3 left
  shift 3
  left=$(( TOTAL_BUDGET - $(elapsed) ))
  if [ "$left" -lt "$limit" ]; then
    echo "SKIPPED $name (${left} s left, it needs ${limit})" | tee -a "$OUT/verdict.txt"
    return
  fi
  echo "=== $name ($(elapsed) s)"
  if timeout "$limit" "$@" > "$OUT/$file" 2>&1; then
    echo "TABLE   $name: $file" | tee -a "$OUT/verdict.txt"
  else
    echo "NOTABLE $name (exit $?; see $file)" | tee -a "$OUT/verdict.txt"
  fi
}

# ---- stage 1: the gate ------------------------------------------------------------------------------
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >> "$OUT/gate.log" 2>&1 || echo "WARNING: installing .whl failed (see gate.log)"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
  | tee -a "$OUT/gate.log"
arch=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
# The image's toolkit may live elsewhere: take the nvcc on the PATH then.
if [ ! -x "$CUDA_HOME/bin/nvcc" ] && command -v nvcc > /dev/null; then
  CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")
fi
{ "$CUDA_HOME/bin/nvcc" --version | tail -2; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm \
  --format=csv; } 2>&1 | tee -a "$OUT/gate.log"

gate "build for sm_${arch/./} only" 240 env CLEF_CUDA_BUILD=cuda TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS="$(nproc)" \
  "$PY" -m pip install --no-build-isolation --no-deps -e .
"$PY" -c "import clef_cuda; print(clef_cuda.build_info())" | tee -a "$OUT/gate.log"

if [ "$tables_only" = 0 ]; then
# Every test's GPU case (the conftest marks a cuda-backend case `cuda`, as GPU-only tests are by hand).
GATE_TESTS="tests/test_paged_attention.py tests/test_paged_attention_v2.py tests/test_glue.py tests/test_quantize.py \
tests/test_conv1d.py tests/test_gated_delta_rule.py tests/test_key_band.py tests/test_kernel_trials.py tests/test_vocab_tables.py \
tests/test_decider.py"
# shellcheck disable=SC2086
gate "op tests on the GPU, CUDA_LAUNCH_BLOCKING=1" 150 env CUDA_LAUNCH_BLOCKING=1 \
  "$PY" -m pytest $GATE_TESTS -q -p no:cacheprovider -m cuda

sanitizer=$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")
# sanitize TOOL [CASE FLAGS]: every kernel once under TOOL, gated by scripts/sanitizer_verdict.py on the reports
# inside our kernels (cuBLAS's sm_90 GEMMs draw racecheck and initcheck reports of their own: that script says).
sanitize() {
  local tool=$1 status
  shift
  # Without torch's caching allocator every tensor is its own allocation, so memcheck sees a read past one.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" --tool "$tool" --show-backtrace no --print-limit 100000 \
    "$PY" scripts/gpu_sanitize_cases.py "$@" > "$SANITIZER_LOG" 2>&1
  status=$?
  grep -v "^=========" "$SANITIZER_LOG"
  "$PY" scripts/sanitizer_verdict.py "$SANITIZER_LOG" "$status"
}
export -f sanitize
# The tool's raw log stays out of $OUT (8 files come back at most, and a killed run would leave it there).
SANITIZER_LOG=${TMPDIR:-/tmp}/clef_gpu_check_sanitizer.log
export sanitizer PY OUT SANITIZER_LOG
gate "compute-sanitizer memcheck, every kernel once" 90 bash -c 'sanitize "$@"' _ memcheck
gate "compute-sanitizer synccheck, every kernel once" 90 bash -c 'sanitize "$@"' _ synccheck
# The op checks alone (their inputs from torch's generators, not cuBLAS), f16 and int8: each kernel once.
gate "compute-sanitizer racecheck, the op checks" 240 bash -c 'sanitize "$@"' _ racecheck --ops-only --dtypes f16
gate "compute-sanitizer initcheck, the op checks" 120 bash -c 'sanitize "$@"' _ initcheck --ops-only --dtypes f16
rm -f "$SANITIZER_LOG"

flash_dtypes="f16"
"$PY" -c "import sys, torch; sys.exit(torch.cuda.get_device_capability() < (8, 0))" && flash_dtypes="f16 bf16"
for dtype in $flash_dtypes; do
  gate "self-check at clef-flash's shapes, $dtype" 90 "$PY" benchmarks/selfcheck_cost.py --device cuda --dtype "$dtype" \
    --only-flash
done
gate "self-check at clef-flash's shapes, f16 with int8 weights" 90 "$PY" benchmarks/selfcheck_cost.py --device cuda \
  --dtype f16 --quantize int8 --only-flash
gate "shadow tolerance on this GPU, f16 and bf16 (gating)" 150 "$PY" benchmarks/shadow_tolerance.py --device cuda \
  --dtypes f16,bf16 --records 10 --gate

fi  # tables_only

if [ "$gate_failed" = 0 ]; then gate_verdict="PASSED"; else gate_verdict="FAILED"; fi
[ "$tables_only" = 1 ] && gate_verdict="$gate_verdict (the build alone: --tables-only)"
if [ "$(elapsed)" -gt "$GATE_BUDGET" ]; then gate_verdict="$gate_verdict (over its ${GATE_BUDGET} s budget: $(elapsed) s)"; fi
echo "GATE $gate_verdict after $(elapsed) s" | tee -a "$OUT/verdict.txt"

# ---- stage 2: the tables ----------------------------------------------------------------------------
# shellcheck disable=SC2016
table "the delta rule (chunked / serial / FLA by device time) and a 2k decision at clef-flash's shapes by op" 240 \
  delta_rule.md bash -c '"$0" benchmarks/delta_rule_table.py --device cuda &&
    "$0" benchmarks/decision_split.py --device cuda --dtype f16 --tokens 2048 &&
    "$0" benchmarks/decision_split.py --device cuda --dtype f16 --quantize int8 --tokens 2048' "$PY"
table "the ops" 90 ops.md "$PY" benchmarks/kernel_table.py --device cuda
table "attention v1 / v2 / SIMT / SDPA at 2k and 16k, a trunk step by op" 150 attention.md \
  "$PY" benchmarks/attention_table.py --device cuda --contexts 2048,16384
table "int8 dequantize + GEMM vs f16 at 64..4096 rows" 60 int8.md \
  "$PY" benchmarks/int8_table.py --device cuda --dtype float16 --layer-only --rows 64,256,1024,4096 --repeats 20
table "the start-up autotune at clef-flash's shapes" 60 autotune.md \
  "$PY" benchmarks/autotune_table.py --device cuda --dtype f16 --flash --mode fast
left=$(( TOTAL_BUDGET - $(elapsed) ))
if [ "$left" -gt 60 ]; then
  echo "=== the whole suite, for the ${left} s left"
  timeout "$left" "$PY" -m pytest tests -q -p no:cacheprovider --continue-on-collection-errors > "$OUT/suite.log" 2>&1
  echo "SUITE   exit $? ($(tail -1 "$OUT/suite.log"))" | tee -a "$OUT/verdict.txt"
else
  echo "SKIPPED the whole suite (${left} s left)" | tee -a "$OUT/verdict.txt"
fi

echo
for f in delta_rule.md ops.md attention.md int8.md autotune.md; do
  [ -f "$OUT/$f" ] && { echo "--- $f"; tail -40 "$OUT/$f"; }
done
echo "--- verdict ($(elapsed) s)"
cat "$OUT/verdict.txt"
[ "$gate_failed" = 0 ]
