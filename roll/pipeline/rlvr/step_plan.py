"""The decisions of one RLVR step, as pure functions of the config and the batch size.

Which forward passes score the batch before the advantages, whether two of them run at once, and which
row count dynamic sampling keeps a multiple of. `RLVRPipeline.step` runs what these decide.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

from roll.configs.algorithm_config import AlgorithmArguments
from roll.configs.worker_config import WorkerConfig
from roll.pipeline.base.residency import Phase
from roll.pipeline.rlvr import phases
from roll.pipeline.rlvr.rollout import consumer_row_multiple, optimizer_step_rows


class LogProbPass(NamedTuple):
    """A forward pass over the batch: the role that runs it, its phase, and the key its `log_probs` get."""

    role: str
    phase: Phase
    key: str


REFERENCE_PASS = LogProbPass("reference", phases.REFERENCE_LOG_PROBS, "ref_log_probs")
TEACHER_PASS = LogProbPass("teacher", phases.TEACHER_LOG_PROBS, "teacher_log_probs")
OLD_LOG_PROBS_PASS = LogProbPass("actor_train", phases.OLD_LOG_PROBS, "old_log_probs")


def needs_old_log_prob_pass(algorithm: AlgorithmArguments, actor_train: WorkerConfig, batch_rows: int) -> bool:
    """Whether actor_train scores the batch before the update, or the update takes its old log-probs itself.

    One epoch of one optimizer step starts from the weights a separate pass would score, so the update can
    take them from its own forward pass; a KL reward penalty and the teacher's reward read them before the
    update. "always" keeps the pass for ablations and bit-for-bit reproduction of earlier runs.
    """
    if algorithm.old_log_probs_pass == "always":
        return True
    read_before_update = (
        algorithm.kl_penalty_coef != 0 or algorithm.adaptive_kl_target is not None or algorithm.needs_teacher
    )
    one_update = algorithm.ppo_epochs == 1 and batch_rows == optimizer_step_rows(actor_train)
    return read_before_update or not one_update


def log_prob_passes(roles: Collection[str], old_log_probs: bool) -> list[LogProbPass]:
    """The passes before the advantages, in order: the reference's and the teacher's if they run, then
    actor_train's old log-probs if `old_log_probs` (see `needs_old_log_prob_pass`)."""
    passes = [p for p in (REFERENCE_PASS, TEACHER_PASS) if p.role in roles]
    return [*passes, OLD_LOG_PROBS_PASS] if old_log_probs else passes


def runs_concurrently(passes: Sequence[LogProbPass], roles: Mapping[str, WorkerConfig]) -> bool:
    """Whether `passes` run at the same time (phase `reference_and_old_log_probs`): exactly the reference's
    and actor_train's, on disjoint devices. On shared devices they would only compete for the same cores."""
    if [p.role for p in passes] != [REFERENCE_PASS.role, OLD_LOG_PROBS_PASS.role]:
        return False
    return set(roles["reference"].devices).isdisjoint(roles["actor_train"].devices)


def dynamic_sampling_row_multiple(roles: Mapping[str, WorkerConfig]) -> int:
    """The row count dynamic sampling keeps a multiple of: whole optimizer steps of actor_train and the critic
    (if it trains), whole shards of the reference's and the teacher's ranks (if they score)."""
    trainers = [roles[name] for name in ("actor_train", "critic") if name in roles]
    forward_roles = [roles[name] for name in ("reference", "teacher") if name in roles]
    return consumer_row_multiple(trainers, forward_roles)
