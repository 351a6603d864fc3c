"""Engine lifecycle calls vLLM's public `LLM` class lacks."""

from __future__ import annotations

from vllm import LLM
from vllm.distributed.parallel_state import cleanup_dist_env_and_memory


def shutdown_engine(llm: LLM) -> None:
    """Stop the engine core (and its worker processes, if any) and leave vLLM's process groups."""
    llm.llm_engine.engine_core.shutdown()
    cleanup_dist_env_and_memory()
