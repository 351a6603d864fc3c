"""The phases of one RLVR step, each with the roles whose states it needs on their devices."""

from __future__ import annotations

from roll.pipeline.base.residency import phase

SYNC_WEIGHTS = phase("sync_weights", "actor_train", "actor_infer")
GENERATE = phase("generate", "actor_infer")
REWARDS = phase("rewards")
REFERENCE_LOG_PROBS = phase("reference_log_probs", "reference")
TEACHER_LOG_PROBS = phase("teacher_log_probs", "teacher")
OLD_LOG_PROBS = phase("old_log_probs", "actor_train")
# Both passes at once, when the reference and actor_train are on disjoint devices.
REFERENCE_AND_OLD_LOG_PROBS = phase("reference_and_old_log_probs", "reference", "actor_train")
VALUES = phase("values", "critic")
ADVANTAGES = phase("advantages")
CRITIC_UPDATE = phase("critic_update", "critic")
ACTOR_UPDATE = phase("actor_update", "actor_train")
# Every phase a step may time, in step order (benchmarks list their timings in it).
STEP_PHASES = (
    SYNC_WEIGHTS,
    GENERATE,
    REWARDS,
    REFERENCE_LOG_PROBS,
    TEACHER_LOG_PROBS,
    OLD_LOG_PROBS,
    REFERENCE_AND_OLD_LOG_PROBS,
    VALUES,
    ADVANTAGES,
    CRITIC_UPDATE,
    ACTOR_UPDATE,
)
