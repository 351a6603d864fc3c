"""The distillation config's checks (teacher model, strategy and vocabulary, step rows, loss options) and its plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from roll.configs.loader import load_pipeline_config, yaml_names
from roll.configs.schema import ConfigError
from roll.models.tiny import build_char_tokenizer, make_tiny_model
from roll.pipeline.base.dry_run.plan import dry_run_report
from roll.pipeline.distill.distill_config import DistillConfig
from tests.conftest import CONFIG_DIR
from tests.unit.test_hydra_configs import compose_config

SMALL_STUDENT = "student.model_args.model_name_or_path='tiny://qwen2?hidden_size=64&num_heads=2&num_kv_heads=1'"


def distill(*overrides: str) -> DistillConfig:
    cfg = compose_config(
        "distill_arithmetic", ["platform=cpu", "devices_per_node=2", "pretrain=tiny://qwen2", *overrides]
    )
    return load_pipeline_config(cfg, DistillConfig, yaml_names([CONFIG_DIR]))


def test_the_default_recipe_validates_with_a_smaller_student_of_the_same_tokenizer() -> None:
    config = distill()
    assert config.student.model_args.model_name_or_path.startswith("tiny://qwen2?hidden_size=64")
    assert config.teacher.strategy_args.strategy_name == "hf_infer" and config.top_k == 8


def test_an_exported_teacher_directory_shares_the_tiny_students_tokenizer(tmp_path: Path) -> None:
    # The RLVR export is a saved tiny model: its tokenizer reloads as the tiny:// one, id for id.
    teacher = make_tiny_model(tmp_path / "teacher")
    config = distill(f"pretrain={teacher}", SMALL_STUDENT)
    assert config.teacher.model_args.model_name_or_path == str(teacher)


def test_a_missing_teacher_says_to_run_the_main_job_first(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as error:
        distill(f"output_dir={tmp_path}", f"pretrain={tmp_path}/rlvr/model")
    message = str(error.value)
    assert message.startswith(f"teacher.model_args.model_name_or_path='{tmp_path}/rlvr/model' does not exist")
    assert "`bash scripts/run.sh`" in message and "run it first" in message


def test_teachers_and_students_of_different_tokenizers_are_refused_naming_both(tmp_path: Path) -> None:
    other = tmp_path / "digits_only"
    tokenizer = build_char_tokenizer("0123456789+-=")
    tokenizer.save_pretrained(other)
    sizes = {"max_position_embeddings": 512, "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4}
    (other / "config.json").write_text(
        json.dumps({**sizes, "model_type": "qwen2", "intermediate_size": 256, "vocab_size": len(tokenizer)})
    )
    with pytest.raises(ConfigError) as error:
        distill(f"pretrain={other}")
    assert str(error.value) == (
        f"teacher.model_args.model_name_or_path='{other}' and student.model_args.model_name_or_path="
        "'tiny://qwen2?hidden_size=64&num_heads=2&num_kv_heads=1&intermediate_size=128' have different tokenizers: "
        "distillation compares their log-probs token by token; use a teacher and a student of one tokenizer"
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["teacher.strategy_args.strategy_name=deepspeed_train", "+teacher.strategy_args.strategy_config={}"],
            "teacher.strategy_args.strategy_name=deepspeed_train: the teacher is frozen; use hf_infer or "
            "deepspeed_infer (forward passes) or vllm",
        ),
        (
            ["teacher.strategy_args.strategy_name=vllm", "+teacher.strategy_args.strategy_config.max_logprobs=4"],
            "teacher.strategy_args.strategy_config.max_logprobs=4 caps the top log-probs below the 8 this role",
        ),
        (["student.strategy_args.strategy_name=hf_infer", "student.strategy_args.strategy_config={}"], "student."),
        (["batch_size=32"], "batch_size=32 must equal student per_device_train_batch_size x"),
        (["loss.forward_weight=0.3"], "loss.forward_weight=0.3 applies to loss.kind=mixed only, not forward"),
        (["top_k=1000"], "top_k=1000 is more than the models' "),
        (["max_response_length=600"], "max_response_length=600 = 616 tokens is more than"),
    ],
)
def test_bad_relations_are_config_errors_naming_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=None) as error:
        distill(*overrides)
    assert message in str(error.value)


def test_a_vllm_teacher_gets_max_logprobs_for_its_top_k() -> None:
    config = distill("teacher.strategy_args.strategy_name=vllm", "top_k=32")
    assert config.teacher.strategy_args.strategy_config == {"max_logprobs": 32}


def test_a_mix_with_its_weight_and_a_tail_free_support_validate() -> None:
    config = distill("loss.kind=mixed", "loss.forward_weight=0.3", "loss.support=renormalized", "loss.nll_weight=0.5")
    assert (config.loss.kind, config.loss.forward_weight, config.loss.support) == ("mixed", 0.3, "renormalized")


def test_the_dry_run_plans_both_roles_batches() -> None:
    text = "\n".join(dry_run_report(distill()))
    assert "teacher: 32 demonstrations per rank on 2 rank(s) in forward passes of 128, top 8 log-probs" in text
    assert "student: 64 demonstrations per optimizer step = 2 rank(s) x micro-batches of 32 x 1 accumulation" in text
