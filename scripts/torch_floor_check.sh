#!/usr/bin/env bash
# The V100 image's torch, tested: the Dockerfile pins an older torch (TORCH_VERSION, the cu126 line, the
# last with sm_70 kernels) than the development venv. This installs that torch (PyPI's build of it is the
# same cu126 wheel) into a second venv, installs the package there NON-editable (as the image does), and
# runs the server, decider, self-check and image tests and the README example from a copy of the tests outside
# the source tree, so the installed package is what they import. pyproject.toml's torch floor is this
# version (tests/test_build.py checks both agree).
#
# The extension is built CPU-only here: nvcc 13 cannot build against a CUDA 12.6 torch (and the image
# builds the CUDA kernels with its own 12.6 toolkit). Cost on 2 cores: ~6 minutes (torch and its CUDA
# libraries ~2 min, the build ~1 min, the tests ~2 min).
#
#   VENV=path (default .venv-torch-floor)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-torch-floor}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=$(sed -n 's/^ARG TORCH_VERSION=//p' Dockerfile)
TORCHVISION_VERSION=$(sed -n 's/^ARG TORCHVISION_VERSION=//p' Dockerfile)  # the image decodes with it
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
VENV=$(cd "$VENV" && pwd)  # the tests run from another directory
echo "== torch $TORCH_VERSION (the Dockerfile's) and the test dependencies into $VENV"
grep -v -E '^(torch|torchvision)([=<> ]|$)' requirements-dev.txt > "$VENV/requirements-floor.txt"
"$VENV/bin/pip" install -q "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" -r "$VENV/requirements-floor.txt"
"$VENV/bin/pip" install -q --no-deps clef-finetune==0.1.0
echo "== clef-cuda, non-editable, CPU kernels"
CLEF_CUDA_BUILD=cpu MAX_JOBS=${MAX_JOBS:-2} "$VENV/bin/pip" install -q --no-build-isolation --no-deps --force-reinstall .

run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
cp -r tests training README.md docs "$run"/
cd "$run"
"$VENV/bin/python" -c "import clef_cuda, torch, sys; assert clef_cuda.__file__.startswith(sys.prefix), clef_cuda.__file__; \
print('== testing', clef_cuda.__file__, 'with torch', torch.__version__, clef_cuda.build_info())"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -c /dev/null --rootdir "$run" \
  tests/test_server.py tests/test_decider.py tests/test_selfcheck.py tests/test_vision.py tests/test_vision_server.py \
  tests/test_clef_tiny.py::test_readme_curl_example_answers_as_printed tests/test_clef_tiny.py::test_golden_answers \
  -m "not simulator"
