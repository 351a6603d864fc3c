"""How much host memory a vLLM engine on CPU claims for its KV cache.

vLLM allocates and zeroes the whole space when the engine starts (about 3 CPU-seconds per GiB on 2 cores), so a
small model should not claim a GiB it cannot fill. Left unset (`kv_cache_space_gb: null`), the space holds
`KV_CACHE_SEQUENCES` sequences of the engine's longest length, and at most `KV_CACHE_CAP_GB` GiB, which a model of
0.5B parameters already fills. Torch-free, so the dry run's memory estimate uses the same rule.
"""

from __future__ import annotations

GiB = 2**30
KV_CACHE_CAP_GB = 1.0
# vLLM's default batch of an offline engine (`max_num_seqs` of `vllm.LLM`).
KV_CACHE_SEQUENCES = 256


def cpu_kv_cache_bytes(space_gb: float | None, bytes_per_token: int | None, max_tokens: int | None) -> int:
    """`space_gb` GiB when set; else room for `KV_CACHE_SEQUENCES` sequences of `max_tokens` tokens at
    `bytes_per_token`, at most `KV_CACHE_CAP_GB` GiB (the cap itself when either size is unknown)."""
    if space_gb is not None:
        return int(space_gb * GiB)
    cap = int(KV_CACHE_CAP_GB * GiB)
    if bytes_per_token is None or max_tokens is None:
        return cap
    return min(cap, KV_CACHE_SEQUENCES * max_tokens * bytes_per_token)
