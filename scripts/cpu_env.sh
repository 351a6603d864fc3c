#!/usr/bin/env bash
# Thread caps for small shared machines: every process (driver, Ray workers, pytest) defaults to one
# BLAS/OpenMP thread; roll's workers raise their own cap to the cores of their device slot.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
# No model hub is reachable on CI machines: fail fast instead of retrying downloads.
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
export RAY_USAGE_STATS_ENABLED=0
export RAY_DEDUP_LOGS="${RAY_DEDUP_LOGS:-0}"
# torch's CPU allocator backs large tensors with transparent huge pages: state offloads between
# phases commit fresh memory, which is about twice as fast with them (docs/offload.md).
export THP_MEM_ALLOC_ENABLE="${THP_MEM_ALLOC_ENABLE:-1}"
