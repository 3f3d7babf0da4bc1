#!/usr/bin/env bash
# Sets up .venv, idempotently, for serving or for the tests; re-running it only rebuilds what changed.
#
#   bash scripts/setup_env.sh serve   make serve: the torch for the GPU found (scripts/setup_plan.py: a V100 gets
#                                     torch 2.7.1 and a CUDA 12 toolkit, newer cards 2.14.1 and CUDA 13; or one line
#                                     naming the toolkit the card needs, exit 2), the server's pinned dependencies
#                                     (requirements-serve.txt), the kernels built for that card. No test tooling.
#   bash scripts/setup_env.sh test    make test (the default): torch 2.14.1, the test and lint dependencies, the
#                                     oracles that must stay out of site-packages, CUDA 12.9's NVRTC for the sm_70
#                                     check, Debian's haproxy, prometheus, chromium and chromium-driver where
#                                     apt-get may run, and the build.
#   --dry-run                         print what would be installed and built, change nothing
#
#   CLEF_CUDA_BUILD=auto|cuda|cpu  (test: default auto, CUDA kernels when torch has CUDA and nvcc is found)
#   VENV=path                       (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=test
DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    serve|test) MODE=$arg ;;
    --dry-run) DRY_RUN=1 ;;
    *) echo "setup_env.sh: unknown argument $arg (serve, test, --dry-run)" >&2; exit 2 ;;
  esac
done
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

# Each step that changes the machine goes through `run`: --dry-run prints it instead.
run() {
  if [ "$DRY_RUN" = 1 ]; then echo "would run: $*"; else "$@"; fi
}

plan=$("$PYTHON" scripts/setup_plan.py --mode "$MODE") || exit 2  # it printed the one line saying why
eval "$plan"
echo "== $MODE set-up: $SETUP_PLAN"
[ -n "${TORCH_CUDA_ARCH_LIST:-}" ] && export TORCH_CUDA_ARCH_LIST
[ -n "${CUDA_HOME:-}" ] && export CUDA_HOME
[ -n "${CLEF_CUDA_BUILD:-}" ] && export CLEF_CUDA_BUILD

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  run "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP="$VENV/bin/pip"

installed_torch=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)
if [ "$installed_torch" != "$TORCH_VERSION" ]; then
  echo "== installing torch==$TORCH_VERSION torchvision==$TORCHVISION_VERSION"
  run "$PIP" install -q "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
fi

if [ "$MODE" = serve ]; then
  echo "== installing the server's dependencies (requirements-serve.txt)"
  run "$PIP" install -q -r requirements-serve.txt "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
else
  echo "== installing test and lint dependencies"
  run "$PIP" install -q -r requirements-dev.txt "torch==$TORCH_VERSION"
  # The upstream reference (clef_finetune/_vendor/joint_schema_model.py) is a test oracle; its own
  # dependencies (peft, datasets, ...) are for fine-tuning and not needed.
  run "$PIP" install -q --no-deps clef-finetune==0.1.0

  # FLA's naive.py is an oracle loaded by file path. Installed as a package, fla would make transformers
  # route its Qwen3.5 fallbacks (our other oracles) to Triton kernels that cannot run on a CPU.
  if [ ! -f .oracles/fla/fla/ops/gated_delta_rule/naive.py ]; then
    echo "== installing the FLA oracle into .oracles/fla"
    run "$PIP" install -q --no-deps --target .oracles/fla fla-core==0.6.0
  fi
  # nvcc 13 cannot target sm_70; CUDA 12.9's NVRTC (PyPI) checks that the kernels still compile for V100.
  if [ ! -f .cache/nvrtc12/nvidia/cuda_nvrtc/lib/libnvrtc.so.12 ]; then
    echo "== installing CUDA 12.9 NVRTC into .cache/nvrtc12"
    run "$PIP" install -q --no-deps --target .cache/nvrtc12 "nvidia-cuda-nvrtc-cu12==12.9.*" \
      "nvidia-cuda-nvcc-cu12==12.9.*" "nvidia-cuda-cccl-cu12==12.9.*" "nvidia-cuda-runtime-cu12==12.9.*"
  fi

  # Debian packages the tests drive, installed where this machine lets us (root or sudo with apt-get, as on the
  # dev machines and CI); said otherwise, naming the tests that will fail.
  apt_packages=(haproxy prometheus chromium chromium-driver)
  apt_missing=()
  command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || apt_missing+=(haproxy)
  command -v promtool >/dev/null && command -v prometheus >/dev/null || apt_missing+=(prometheus)
  command -v chromium >/dev/null || apt_missing+=(chromium)
  command -v chromedriver >/dev/null || apt_missing+=(chromium-driver)
  apt_line="apt-get install -y -q --no-install-recommends"
  if [ ${#apt_missing[@]} -gt 0 ]; then
    why="the affinity test (haproxy), the alert rules' tests (prometheus), the status page's browser test (chromium)"
    sudo=$([ "$(id -u)" = 0 ] && echo "" || { command -v sudo >/dev/null && echo sudo; } || echo none)
    if [ "$sudo" != none ] && command -v apt-get >/dev/null; then
      echo "== installing ${apt_missing[*]} (Debian) for $why"
      export DEBIAN_FRONTEND=noninteractive
      if [ "$DRY_RUN" = 1 ]; then
        echo "would run: $sudo $apt_line ${apt_missing[*]} (after apt-get update if that fails)"
      else
        $sudo $apt_line "${apt_missing[@]}" >/dev/null \
          || { $sudo apt-get update -q >/dev/null && $sudo $apt_line "${apt_missing[@]}" >/dev/null; } \
          || echo "WARNING: installing ${apt_missing[*]} failed: $why will fail"
      fi
    else
      echo "WARNING: ${apt_missing[*]} not installed and cannot be installed here (no apt-get, or not root): $why will fail"
    fi
  elif [ "$DRY_RUN" = 1 ]; then
    echo "== Debian packages ${apt_packages[*]}: already installed (a fresh machine runs: $apt_line ${apt_packages[*]})"
  fi
  # The reference decodes videos with torchcodec only, which must stay out of this venv (it would change how the
  # reference decodes images): the video oracle (tests/video_oracle.py) runs in a venv of its own holding torchcodec
  # alone, this venv's packages reached through a .pth line, PyAV's FFmpeg beneath it (tests/video_oracle.py).
  if ! .venv-video-oracle/bin/python -c "import importlib.util as u; assert u.find_spec('torchcodec')" 2>/dev/null; then
    echo "== the video oracle's venv (.venv-video-oracle: torchcodec beside this venv's packages)"
    run "$PYTHON" -m venv .venv-video-oracle
    run .venv-video-oracle/bin/pip install -q --no-deps torchcodec==0.17.0
    if [ "$DRY_RUN" = 0 ]; then
      "$PY" -c "import site; print(site.getsitepackages()[0])" \
        > "$(.venv-video-oracle/bin/python -c 'import site; print(site.getsitepackages()[0])')/clef-test-venv.pth"
    fi
  fi
fi
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda  # the same build (and stamp) for make serve and make test on a machine
fi

# pip builds in a fresh temporary directory each time (a full recompile), so skip it while the sources and
# build settings are unchanged.
stamp=$( (cat setup.py pyproject.toml; find csrc -type f | sort | xargs cat; \
          echo "${CLEF_CUDA_BUILD:-auto} ${TORCH_CUDA_ARCH_LIST:-} ${CUDA_HOME:-} $TORCH_VERSION") \
        | sha256sum | cut -d' ' -f1)
if [ "$(cat .cache/build.stamp 2>/dev/null)" != "$stamp" ] || ! "$PY" -c "import clef_cuda; clef_cuda.build_info()" 2>/dev/null; then
  echo "== building clef_cuda._C (CLEF_CUDA_BUILD=${CLEF_CUDA_BUILD:-auto}, TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-default}, MAX_JOBS=${MAX_JOBS:-$(nproc)})"
  start=$(date +%s)
  MAX_JOBS=${MAX_JOBS:-$(nproc)} run "$PIP" install -q --no-build-isolation --no-deps -e .
  [ "$DRY_RUN" = 1 ] || { mkdir -p .cache && echo "$stamp" > .cache/build.stamp; }
  echo "== built in $(( $(date +%s) - start )) s"
fi
[ "$DRY_RUN" = 1 ] || "$PY" -c "import clef_cuda; print('== clef_cuda._C:', clef_cuda.build_info())"
