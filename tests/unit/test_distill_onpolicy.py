"""On-policy distillation in RLVR: the teacher's per-token reward by hand, and the config's checks."""

from __future__ import annotations

import pytest
import torch

from roll.configs.algorithm_config import AlgorithmArguments
from roll.configs.loader import load_pipeline_config, yaml_names
from roll.configs.schema import ConfigError
from roll.distributed.scheduler.protocol import DataProto
from roll.pipeline.rlvr.rlvr_config import RLVRConfig
from roll.pipeline.rlvr.rollout import compute_advantages
from tests.conftest import CONFIG_DIR
from tests.unit.test_hydra_configs import compose_config

# Two samples of up to 3 tokens; the second has 2 (its third position is padding, with garbage log-probs).
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.1, -9.0]])
TEACHER = torch.tensor([[-0.5, -2.5, -0.5], [-1.2, -0.1, 3.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def rollout(scores: list[float]) -> DataProto:
    return DataProto.from_dict(
        tensors={
            "scores": torch.tensor(scores),
            "old_log_probs": OLD,
            "teacher_log_probs": TEACHER,
            "response_mask": MASK,
        }
    )


def test_each_token_is_rewarded_by_the_teachers_log_prob_minus_the_samplers() -> None:
    algorithm = AlgorithmArguments(adv_estimator="reinforce_plus_plus", teacher_kl_coef=2.0, score_weight=0.0)
    batch, metrics = compute_advantages(rollout([1.0, 0.0]), torch.tensor([0, 1]), algorithm, kl_coef=0.0)
    # 2 * (teacher - old) inside the mask: [1, -1, 0] and [-2, 0, 0]; the score is weighed 0.
    expected = torch.tensor([[1.0, -1.0, 0.0], [-2.0, 0.0, 0.0]])
    torch.testing.assert_close(batch.batch["token_rewards"], expected)
    # Per-sequence mean of old - teacher (the k1 reverse KL): (-0.5 + 0.5 + 0) / 3 and (1 + 0) / 2.
    assert metrics["actor/teacher_reverse_kl"] == pytest.approx((0.0 + 0.5) / 2)
    # REINFORCE++ returns-to-go of the first sample (gamma 1): 0, -1, 0.
    torch.testing.assert_close(batch.batch["returns"][0], torch.tensor([0.0, -1.0, 0.0]))


def test_a_score_weight_keeps_the_verifiable_score_beside_the_teachers_signal() -> None:
    algorithm = AlgorithmArguments(adv_estimator="reinforce_plus_plus", teacher_kl_coef=1.0, score_weight=0.5)
    batch, _ = compute_advantages(rollout([1.0, 1.0]), torch.tensor([0, 1]), algorithm, kl_coef=0.0)
    # 0.5 on each sample's last response token, plus (teacher - old).
    expected = torch.tensor([[0.5, -0.5, 0.5], [-1.0, 0.5, 0.0]])
    torch.testing.assert_close(batch.batch["token_rewards"], expected)


TEACHER_ROLE = "teacher.model_args.model_name_or_path=tiny://qwen2"


def onpolicy(*overrides: str) -> RLVRConfig:
    base = ["platform=cpu", "devices_per_node=2", "pretrain='tiny://qwen2?hidden_size=64&num_heads=2&num_kv_heads=1'"]
    cfg = compose_config("distill_onpolicy_arithmetic", [*base, *overrides])
    return load_pipeline_config(cfg, RLVRConfig, yaml_names([CONFIG_DIR]))


def test_the_recipe_adds_the_teacher_to_the_roles_a_step_uses() -> None:
    config = onpolicy(TEACHER_ROLE)
    assert list(config.trainer_side_roles()) == ["actor_train", "teacher"]
    assert config.algorithm.needs_teacher and not config.algorithm.needs_reference


def test_a_missing_teacher_export_says_to_run_the_main_job_first(tmp_path: object) -> None:
    with pytest.raises(ConfigError, match=r"teacher.model_args.model_name_or_path='.*/rlvr/model' does not exist"):
        onpolicy(f"output_dir={tmp_path}")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["teacher=null"], "algorithm.teacher_kl_coef=1.0 needs the teacher role; configure teacher"),
        ([TEACHER_ROLE, "algorithm.teacher_kl_coef=0"], "teacher is configured but algorithm.teacher_kl_coef=0"),
        (
            [TEACHER_ROLE, "algorithm.adv_estimator=grpo"],
            "algorithm.adv_estimator=grpo sums a sequence's rewards into one score",
        ),
        (
            [
                TEACHER_ROLE,
                "teacher.strategy_args.strategy_name=vllm",
                "algorithm.log_prob_temperature=sampling",
                "actor_infer.generating_args.temperature=0.7",
            ],
            "teacher.strategy_args.strategy_name=vllm scores at temperature 1 (the engine's prompt log-probs)",
        ),
        (
            [
                TEACHER_ROLE,
                "teacher.strategy_args.strategy_name=deepspeed_train",
                "+teacher.strategy_args.strategy_config={}",
            ],
            "the teacher is frozen",
        ),
    ],
)
def test_bad_teacher_settings_are_config_errors_naming_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        onpolicy(*overrides)
    assert message in str(error.value)
