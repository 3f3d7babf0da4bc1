# syntax=docker/dockerfile:1
# clef-serve for V100 (sm_70) and newer NVIDIA GPUs.
#
# Build (V100, the default):
#   docker build -t clef-serve:sm70 .
# Other GPUs (the arch list is passed to the CUDA build as TORCH_CUDA_ARCH_LIST; 6.0 covers P100 and P40,
# 7.5 the T4, 8.0 A100/A10/L4/RTX 30x0-40x0):
#   docker build --build-arg TORCH_CUDA_ARCH_LIST="6.0;7.0;7.5;8.0;9.0" -t clef-serve:multi .
# Run (the release mounted read-only, as the Kubernetes Deployment does):
#   docker run --gpus 1 -p 8080:8080 -v /models:/mnt/models:ro clef-serve:sm70 --w /mnt/models/clef-flash --d 0 --dtype f16
#
# CUDA 12.6 is the newest toolkit line that still targets sm_70, and PyTorch's cu126 wheels still ship
# sm_70 kernels (cu128 and later dropped Volta); the build stage checks both.

ARG CUDA_VERSION=12.6.3
ARG UBUNTU_VERSION=22.04

# ---- build: compile clef_cuda._C against the CUDA toolkit and torch ---------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS build
ARG TORCH_VERSION=2.7.1
# The torchvision built for that torch (images are decoded and resized with it), from the same index.
ARG TORCHVISION_VERSION=0.22.1
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
ARG TORCH_CUDA_ARCH_LIST=7.0
ARG MAX_JOBS=8
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/clef
ENV PATH=/opt/clef/bin:$PATH CUDA_HOME=/usr/local/cuda
RUN pip install --no-cache-dir --upgrade pip setuptools wheel ninja \
 && pip install --no-cache-dir "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" --index-url "${TORCH_INDEX_URL}" \
 && python -c "import torch, os; flags = torch._C._cuda_getArchFlags(); archs = os.environ['TORCH_CUDA_ARCH_LIST'].replace('.', '').split(';'); missing = [a for a in archs if 'sm_' + a.removesuffix('+PTX') not in flags]; assert not missing, f'torch lacks sm_{missing}: {flags}'"
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY csrc ./csrc
COPY clef_cuda ./clef_cuda
COPY app ./app
RUN CLEF_CUDA_BUILD=cuda TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" MAX_JOBS="${MAX_JOBS}" \
    pip install --no-cache-dir --no-build-isolation . \
 && python -c "import clef_cuda; info = clef_cuda.build_info(); print(info); assert info['variant'] == 'cuda'"

# ---- runtime: the CUDA runtime only, the venv, a non-root user ----------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --create-home --shell /usr/sbin/nologin clef
COPY --from=build /opt/clef /opt/clef
ENV PATH=/opt/clef/bin:$PATH \
    PYTHONUNBUFFERED=1
USER 10001
WORKDIR /home/clef
EXPOSE 8080
# /health answers as soon as the process listens (the weights load in the background; /ready says when
# they are in); the start period covers that load.
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
  CMD ["python3", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=4).status == 200 else 1)"]
ENTRYPOINT ["clef-serve"]
CMD ["--w", "/mnt/models/clef-flash", "--d", "0", "--dtype", "f16", "--p", "8080"]
