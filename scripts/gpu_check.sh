#!/usr/bin/env bash
# The GPU check: one command for a lent GPU machine (budget: under 8 minutes on an H200). Builds the
# extension for the local arch, runs the whole test suite (the CUDA backend joins every op test when a GPU
# is present), runs the on-device self-check in each dtype, then times the ops; the table is printed last
# and written to $OUT/gpu_table.md.
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

step "tests (cpu, simulated and real CUDA backends)"
set +e
$PY -m pytest tests -q -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -15
tests_status=${PIPESTATUS[0]}
set -e

step "the on-device self-check on this GPU (the embedded model, each serving dtype; then its cost at clef-flash shapes)"
selfcheck_status=0
for dtype in f16 bf16 f32; do
  $PY -m app --selfcheck-only --d 0 --dtype "$dtype" --log-level warning 2>&1 | tee -a "$OUT/selfcheck.log" | tail -1 \
    || selfcheck_status=1
done
$PY benchmarks/selfcheck_cost.py --device cuda --dtype f16 2>&1 | tail -8 | tee -a "$OUT/selfcheck.log" || true

step "benchmarks"
rm -f "$OUT/gpu_table.md"
$PY benchmarks/kernel_table.py --device cuda --markdown "$OUT/gpu_table.md" 2>&1 | grep -v "^|" | grep -v "^###" || true

step "done: tests $([ "$tests_status" = 0 ] && echo passed || echo FAILED, see $OUT/tests.log); self-check $([ "$selfcheck_status" = 0 ] && echo passed || echo FAILED, see $OUT/selfcheck.log); the table:"
cat "$OUT/gpu_table.md"
[ "$tests_status" = 0 ] && [ "$selfcheck_status" = 0 ]
