#!/usr/bin/env bash
# The GPU check: one command for a lent GPU machine (budget: under 8 minutes on an H200). Builds the
# extension for the local arch; runs the op tests on the GPU first with CUDA_LAUNCH_BLOCKING=1 (a fault is
# raised by the op that caused it) and then under compute-sanitizer (memcheck on the op tests, racecheck on
# the tensor-core attention kernel's); runs the whole test suite (the CUDA backend joins every op test when
# a GPU is present) and the on-device self-check in each dtype, with int8 weights, and at clef-flash's
# shapes (gating: the tensor-core kernel at head dim 256); then times the ops ($OUT/gpu_table.md) and
# the start-up autotune's table at clef-flash's shapes ($OUT/autotune.md), attention prefill, our WMMA
# and SIMT kernels against SDPA's backends plus one trunk step split by op
# ($OUT/attention_table.md) and at 16k with one record ($OUT/attention_16k.md, printed last), and runs one
# Nsight Compute pass on the WMMA kernel when ncu exists ($OUT/ncu_wmma.txt).
#
# The device machine has no network. Prepare its Python packages here first (they travel with the tree):
#   pip download -d .cache/wheelhouse --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -r scripts/gpu_check_requirements.txt
#   pip install --no-deps --target .oracles/fla fla-core==0.6.0
# then run, through the device tool, with carry [".cache/wheelhouse", ".oracles"]:
#   bash scripts/gpu_check.sh
# and commit the table to benchmarks/RESULTS.md with the date and device.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.cache/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
t0=$(date +%s)
step() { echo; echo "=== $* ($(( $(date +%s) - t0 )) s)"; }

step "python packages"
if [ -d .cache/wheelhouse ]; then
  $PY -m pip install -q --no-index --find-links .cache/wheelhouse -r scripts/gpu_check_requirements.txt
fi
$PY -c "import torch, transformers, pytest; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

step "build for the local GPU"
arch=$($PY -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
CLEF_CUDA_BUILD=cuda TORCH_CUDA_ARCH_LIST=$arch MAX_JOBS=$(nproc) \
  $PY -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tee "$OUT/build.log" | grep -v Warning || true
$PY -c "import clef_cuda; info = clef_cuda.build_info(); print(info); assert info['variant'] == 'cuda'"

# The op tests' GPU cases (the simulator's run in the whole suite below).
OP_TESTS="tests/test_paged_attention.py tests/test_conv1d.py tests/test_gated_delta_rule.py tests/test_key_band.py"
step "op tests on the GPU, CUDA_LAUNCH_BLOCKING=1 (a kernel fault is raised by the op that caused it)"
set +e
CUDA_LAUNCH_BLOCKING=1 $PY -m pytest $OP_TESTS -q -p no:cacheprovider -k "cuda and not sim" 2>&1 \
  | tee "$OUT/op_tests_blocking.log" | tail -5
blocking_status=${PIPESTATUS[0]}
set -e

step "compute-sanitizer: memcheck on the op tests, racecheck on the tensor-core attention kernel"
sanitizer=$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")
sanitizer_status=0
if [ -x "$sanitizer" ]; then
  set +e
  # Without torch's caching allocator every tensor is its own allocation, so memcheck sees any read past one.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 240 "$sanitizer" --tool memcheck --error-exitcode 3 --print-limit 20 \
    $PY -m pytest $OP_TESTS -q -p no:cacheprovider -k "cuda and not sim" 2>&1 | tee "$OUT/memcheck.log" | tail -5
  memcheck_status=${PIPESTATUS[0]}
  timeout 150 "$sanitizer" --tool racecheck --error-exitcode 3 --print-limit 20 \
    $PY -m pytest tests/test_paged_attention.py -q -p no:cacheprovider \
    -k "cuda and (wmma_custom_scale or wmma_chunked)" 2>&1 | tee "$OUT/racecheck.log" | tail -5
  racecheck_status=${PIPESTATUS[0]}
  set -e
  [ "$memcheck_status" = 0 ] && [ "$racecheck_status" = 0 ] || sanitizer_status=1
  echo "memcheck exit $memcheck_status, racecheck exit $racecheck_status (124: timed out)"
else
  echo "compute-sanitizer not found (looked on PATH and in $CUDA_HOME/bin): skipped"
  sanitizer_status=skipped
fi

step "tests (cpu, simulated and real CUDA backends)"
set +e
$PY -m pytest tests -q -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -15
tests_status=${PIPESTATUS[0]}
set -e

step "the on-device self-check on this GPU: the embedded model in each dtype and with int8 weights; then at clef-flash's shapes (the tensor-core attention at head dim 256)"
selfcheck_status=0
for dtype in f16 bf16 f32; do
  $PY -m app --selfcheck-only --d 0 --dtype "$dtype" --log-level warning 2>&1 | tee -a "$OUT/selfcheck.log" | tail -1 \
    || selfcheck_status=1
done
$PY -m app --selfcheck-only --d 0 --dtype f16 --quantize int8 --log-level warning 2>&1 | tee -a "$OUT/selfcheck.log" \
  | tail -1 || selfcheck_status=1
# Random weights at clef-flash's real shapes, one layer of each kind: clef-tiny's head dim 32 never reaches the
# tensor-core kernel, these do. Gating: a failure here fails the check.
flash_dtypes="f16"
$PY -c "import sys, torch; sys.exit(torch.cuda.get_device_capability() < (8, 0))" && flash_dtypes="f16 bf16"
for dtype in $flash_dtypes; do
  $PY benchmarks/selfcheck_cost.py --device cuda --dtype "$dtype" --only-flash 2>&1 | tail -8 \
    | tee -a "$OUT/selfcheck.log" || selfcheck_status=1
done
$PY benchmarks/selfcheck_cost.py --device cuda --dtype f16 --quantize int8 --only-flash 2>&1 | tail -8 \
  | tee -a "$OUT/selfcheck.log" || selfcheck_status=1

step "shadow verification's healthy differences on this GPU (the tolerance is measured on the CPU so far)"
$PY benchmarks/shadow_tolerance.py --device cuda --dtypes f16,bf16 --records 20 2>&1 | tail -12 \
  | tee "$OUT/shadow_tolerance.txt" || true

step "the start-up autotune on this GPU: every checked candidate timed per bucket, at clef-flash's shapes"
$PY benchmarks/autotune_table.py --device cuda --dtype f16 --flash --mode full 2>&1 | tee "$OUT/autotune.md" | tail -40 || true

step "benchmarks: the ops"
rm -f "$OUT/gpu_table.md" "$OUT/attention_table.md"
$PY benchmarks/kernel_table.py --device cuda --markdown "$OUT/gpu_table.md" 2>&1 | grep -v "^|" | grep -v "^###" || true

step "benchmarks: attention prefill (WMMA, SIMT, SDPA flash / mem-efficient / math) and a trunk step by op"
$PY benchmarks/attention_table.py --device cuda --markdown "$OUT/attention_table.md" 2>&1 \
  | grep -v "^|" | grep -v "^###" || true
step "benchmarks: attention at a 16k context, one record (the long-record case the split-context work targets)"
$PY benchmarks/attention_table.py --device cuda --records 1 --contexts 16384 --no-trunk \
  --markdown "$OUT/attention_16k.md" 2>&1 | grep -v "^|" | grep -v "^###" || true

step "Nsight Compute: one pass over the tensor-core attention kernel at 16k, one record (when ncu exists)"
ncu=$(command -v ncu || echo "$CUDA_HOME/bin/ncu")
if [ -x "$ncu" ]; then
  timeout 180 "$ncu" --kernel-name regex:paged_attention_wmma --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section MemoryWorkloadAnalysis --section LaunchStats \
    $PY benchmarks/attention_table.py --device cuda --records 1 --contexts 16384 --no-trunk \
    > "$OUT/ncu_wmma.txt" 2>&1 || echo "ncu exited $? (see $OUT/ncu_wmma.txt)"
  grep -E "Duration|Throughput|Registers|Shared Memory|Achieved Occupancy|Block Limit" "$OUT/ncu_wmma.txt" | head -30 || true
else
  echo "ncu not found (looked on PATH and in $CUDA_HOME/bin): skipped"
fi

verdict() { [ "$1" = 0 ] && echo passed || { [ "$1" = skipped ] && echo skipped || echo "FAILED, see $2"; }; }
step "done: op tests (blocking) $(verdict "$blocking_status" "$OUT/op_tests_blocking.log"); sanitizer $(verdict "$sanitizer_status" "$OUT/memcheck.log, racecheck.log"); tests $(verdict "$tests_status" "$OUT/tests.log"); self-check $(verdict "$selfcheck_status" "$OUT/selfcheck.log"); the tables:"
cat "$OUT/gpu_table.md" 2>/dev/null || echo "(no ops table: see above)"
echo
cat "$OUT/attention_table.md" 2>/dev/null || echo "(no attention table: see above)"
echo
cat "$OUT/attention_16k.md" 2>/dev/null || echo "(no 16k attention table: see above)"
echo
cat "$OUT/autotune.md" 2>/dev/null || echo "(no autotune table: see above)"
[ "$blocking_status" = 0 ] && [ "$sanitizer_status" != 1 ] && [ "$tests_status" = 0 ] && [ "$selfcheck_status" = 0 ]
