"""Config checks of a teacher role (offline distillation, on-policy distillation in RLVR): the model exists, the
strategy scores given sequences (forward passes, or an engine's prompt log-probs), and teacher and student share
one vocabulary."""

from __future__ import annotations

from pathlib import Path

from roll.configs.schema import ConfigError
from roll.configs.worker_config import WorkerConfig
from roll.distributed.strategy.engine_strategy import EngineStrategy
from roll.distributed.strategy.registry import strategy_class
from roll.models.hub import parse_hub_ref
from roll.models.model_providers import peek_tokenizer
from roll.models.tiny import TINY_SCHEME
from roll.pipeline.base.dry_run.model_shape import model_shape

# Where `bash scripts/run.sh` (SFT, then RLVR) exports the policy it trains: the default teacher.
RUN_SH_EXPORT = "<output_dir>/rlvr/model"


def check_teacher_model(name: str, teacher: WorkerConfig) -> None:
    """A missing directory for teacher role `name` is most often the main job's export not written yet: say how to
    write it (checked before the roles resolve, which would only say that the directory is missing)."""
    path = teacher.model_args.model_name_or_path
    local = path and not path.startswith(TINY_SCHEME) and parse_hub_ref(path) is None  # a hub id is fetched later
    if local and not Path(path).expanduser().is_dir():
        raise ConfigError(
            f"{name}.model_args.model_name_or_path={path!r} does not exist: the default teacher is the policy "
            f"`bash scripts/run.sh` trains (SFT, then RLVR) and exports to {RUN_SH_EXPORT}; run it first, or set "
            f"{name}.model_args.model_name_or_path to a model directory"
        )


def check_teacher_strategy(teacher: WorkerConfig) -> None:
    """The teacher is frozen and scores given sequences: an inference strategy (forward passes or an engine)."""
    name = teacher.strategy_args.strategy_name if teacher.strategy_args else None
    if name is None or strategy_class(name).trains():
        raise ConfigError(
            f"{teacher.name}.strategy_args.strategy_name={name}: the teacher is frozen; use hf_infer or "
            "deepspeed_infer (forward passes) or vllm (prompt log-probs)"
        )


def scores_on_engine(role: WorkerConfig) -> bool:
    """Whether `role` scores given sequences with an engine's prompt log-probs (vllm, sglang), not forward passes."""
    name = role.strategy_args.strategy_name if role.strategy_args else None
    return name is not None and issubclass(strategy_class(name), EngineStrategy)


def check_engine_scoring_temperature(role: WorkerConfig, temperature: float) -> None:
    """An engine scores given sequences at temperature 1 (its prompt log-probs are the model's own distribution);
    a role scoring at another log-prob temperature needs forward passes."""
    if scores_on_engine(role) and temperature != 1.0:
        name = role.strategy_args.strategy_name
        raise ConfigError(
            f"{role.name}.strategy_args.strategy_name={name} scores at temperature 1 (the engine's prompt log-probs), "
            f"but algorithm.log_prob_temperature=sampling scores at {temperature}; set "
            f"algorithm.log_prob_temperature=one, or {role.name}.strategy_args.strategy_name=hf_infer"
        )


def fit_teacher_top_k(teacher: WorkerConfig, student: WorkerConfig, k: int) -> None:
    """Let the teacher's backend return the top-k it is asked for (an engine's `max_logprobs`): `k`, plus the ids of
    the teacher's output layer beyond the student's, which an engine drops from a longer list (`response_top_k`)."""
    sizes = [vocab_size(role.model_args.model_name_or_path) for role in (teacher, student)]
    extra = max(sizes[0] - sizes[1], 0) if None not in sizes else 0
    strategy_class(teacher.strategy_args.strategy_name).fit_top_k(teacher, k + extra)


def tokenizer_vocab(model_path: str) -> dict[str, int]:
    """The token -> id map of `model_path`'s tokenizer (a tiny:// reference's without building its model)."""
    return peek_tokenizer(model_path).get_vocab()


def vocab_size(model_path: str) -> int | None:
    """The size of `model_path`'s output layer from its config (None when the config does not say)."""
    try:
        return model_shape(model_path).vocab_size
    except (ValueError, OSError):
        return None


def check_same_vocabulary(teacher: WorkerConfig, student: WorkerConfig) -> None:
    """Teacher and student have the same tokenizer: their log-probs compare token by token.

    Their output layers may still differ in size (checkpoints pad the embedding differently, e.g. Qwen2.5 0.5B and
    7B); the teacher's distribution is then taken over the ids both have (`shared_vocab_size`).
    """
    paths = teacher.model_args.model_name_or_path, student.model_args.model_name_or_path
    if tokenizer_vocab(paths[0]) != tokenizer_vocab(paths[1]):
        raise ConfigError(
            f"{teacher.name}.model_args.model_name_or_path={paths[0]!r} and "
            f"{student.name}.model_args.model_name_or_path={paths[1]!r} have different tokenizers: distillation "
            "compares their log-probs token by token; use a teacher and a student of one tokenizer"
        )


def shared_vocab_size(teacher: WorkerConfig, student: WorkerConfig) -> int | None:
    """The ids both models' output layers have (None when a config does not say)."""
    sizes = [vocab_size(role.model_args.model_name_or_path) for role in (teacher, student)]
    return None if None in sizes else min(sizes)
