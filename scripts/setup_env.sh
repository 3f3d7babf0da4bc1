#!/usr/bin/env bash
# Sets up .venv for development and tests, idempotently: torch, the test/lint dependencies, the oracles
# that must stay out of site-packages, the CUDA 12.9 NVRTC packages for the sm_70 check, and the build
# of clef_cuda._C. Re-running it only rebuilds what changed.
#
#   CLEF_CUDA_BUILD=auto|cuda|cpu  (default auto: CUDA kernels when torch has CUDA and nvcc is found)
#   VENV=path                       (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
TORCH_VERSION=2.14.1
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if ! python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  echo "== installing torch==$TORCH_VERSION"
  pip install -q "torch==$TORCH_VERSION"
fi
echo "== installing test and lint dependencies"
pip install -q -r requirements-dev.txt "torch==$TORCH_VERSION"
# The upstream reference (clef_finetune/_vendor/joint_schema_model.py) is a test oracle; its own
# dependencies (peft, datasets, ...) are for fine-tuning and not needed.
pip install -q --no-deps clef-finetune==0.1.0

# FLA's naive.py is an oracle loaded by file path. Installed as a package, fla would make transformers
# route its Qwen3.5 fallbacks (our other oracles) to Triton kernels that cannot run on a CPU.
if [ ! -f .oracles/fla/fla/ops/gated_delta_rule/naive.py ]; then
  echo "== installing the FLA oracle into .oracles/fla"
  pip install -q --no-deps --target .oracles/fla fla-core==0.6.0
fi
# nvcc 13 cannot target sm_70; CUDA 12.9's NVRTC (PyPI) checks that the kernels still compile for V100.
if [ ! -f .cache/nvrtc12/nvidia/cuda_nvrtc/lib/libnvrtc.so.12 ]; then
  echo "== installing CUDA 12.9 NVRTC into .cache/nvrtc12"
  pip install -q --no-deps --target .cache/nvrtc12 "nvidia-cuda-nvrtc-cu12==12.9.*" "nvidia-cuda-nvcc-cu12==12.9.*" \
    "nvidia-cuda-cccl-cu12==12.9.*" "nvidia-cuda-runtime-cu12==12.9.*"
fi

# The affinity test (tests/test_routing.py) puts two replicas behind Debian's HAProxy: install it where
# this machine lets us (root with apt-get, as on the dev machines and CI); say so otherwise.
if ! command -v haproxy >/dev/null && [ ! -x /usr/sbin/haproxy ]; then
  sudo=$([ "$(id -u)" = 0 ] || { command -v sudo >/dev/null && echo sudo; } || echo none)
  if [ "$sudo" != none ] && command -v apt-get >/dev/null; then
    echo "== installing haproxy (Debian) for the affinity test"
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get install -y -q --no-install-recommends haproxy >/dev/null \
      || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q --no-install-recommends haproxy >/dev/null; } \
      || echo "WARNING: installing haproxy failed: tests/test_routing.py's affinity test will fail"
  else
    echo "WARNING: haproxy is not installed and cannot be installed here: tests/test_routing.py's affinity test will fail"
  fi
fi

if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
# pip builds in a fresh temporary directory each time (a full recompile), so skip it while the sources and
# build settings are unchanged.
stamp=$( (cat setup.py pyproject.toml; find csrc -type f | sort | xargs cat; \
          echo "${CLEF_CUDA_BUILD:-auto} ${TORCH_CUDA_ARCH_LIST:-} $(python -c 'import torch; print(torch.__version__)')") \
        | sha256sum | cut -d' ' -f1)
if [ "$(cat .cache/build.stamp 2>/dev/null)" != "$stamp" ] || ! python -c "import clef_cuda; clef_cuda.build_info()" 2>/dev/null; then
  echo "== building clef_cuda._C (CLEF_CUDA_BUILD=${CLEF_CUDA_BUILD:-auto}, MAX_JOBS=${MAX_JOBS:-$(nproc)})"
  start=$(date +%s)
  MAX_JOBS=${MAX_JOBS:-$(nproc)} pip install -q --no-build-isolation --no-deps -e .
  mkdir -p .cache && echo "$stamp" > .cache/build.stamp
  echo "== built in $(( $(date +%s) - start )) s"
fi
python -c "import clef_cuda; print('== clef_cuda._C:', clef_cuda.build_info())"
