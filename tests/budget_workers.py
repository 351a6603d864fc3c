"""The actor worker the token-budget integration test drives; Ray workers import it by module path.

It is roll's ActorWorker plus a call that switches the role's micro-batching between calls, so one
DeepSpeed cluster (one start-up) runs the padded, token-budget and packed layouts on the same weights.
"""

from __future__ import annotations

from roll.distributed.scheduler.decorator import Dispatch, register
from roll.pipeline.base.rl_workers import ActorWorker


class BudgetActorWorker(ActorWorker):
    """ActorWorker whose `max_tokens_per_microbatch` and `sequence_packing` the test sets on every rank."""

    @register(Dispatch.ONE_TO_ALL)
    def set_micro_batching(self, max_tokens: int | None, packing: bool) -> None:
        self.worker_config.max_tokens_per_microbatch = max_tokens
        self.worker_config.sequence_packing = packing
