"""The TRL comparison's pieces that need neither Ray nor TRL: roll's configuration and the docs rewrite."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from benchmarks import compare_trl, doc_tables
from roll.configs.hydra_defaults import register_schema_defaults
from roll.configs.loader import load_pipeline_config, yaml_names
from roll.pipeline.rlvr.rlvr_config import RLVRConfig
from tests.conftest import CONFIG_DIR


def test_roll_overrides_give_the_compared_configuration(tmp_path: Path) -> None:
    model_dir, train_file, eval_file = compare_trl.build_inputs("small", tmp_path)
    assert compare_trl.parameter_count(model_dir) == pytest.approx(0.3e6, rel=0.1)
    assert train_file.read_text().count("+") == 2000 and "-" not in train_file.read_text()
    overrides = compare_trl.roll_overrides(model_dir, train_file, eval_file, 32, max_steps=5)
    register_schema_defaults("rlvr", RLVRConfig)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("rlvr_arithmetic", overrides=[*overrides, f"output_dir={tmp_path}"])
    config = load_pipeline_config(cfg, RLVRConfig, yaml_names([CONFIG_DIR]))

    samples = config.rollout_batch_size * config.actor_infer.generating_args.num_return_sequences
    args = config.actor_train.training_args
    assert samples == 128 == args.per_device_train_batch_size * args.gradient_accumulation_steps * 2
    assert config.actor_train.devices == config.actor_infer.devices == config.reference.devices == [0, 1]
    assert config.actor_train.strategy_args.strategy_config["zero_optimization"]["stage"] == 2
    assert config.actor_infer.strategy_args.strategy_name == config.reference.strategy_args.strategy_name == "hf_infer"
    assert {config.actor_train.model_args.dtype, config.reference.model_args.dtype} == {"fp32"}
    algorithm = config.algorithm
    assert algorithm.use_kl_loss and algorithm.kl_loss_coef == 0.04 and algorithm.kl_loss_kind == "k3"
    assert algorithm.kl_penalty_coef == 0 and algorithm.ppo_epochs == 1
    assert config.actor_infer.generating_args.max_new_tokens == 32 and config.cpus_per_device == 1


def test_write_docs_replaces_a_models_row_and_keeps_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = tmp_path / "performance.md"
    begin, end = doc_tables.markers(compare_trl.TABLE)
    rows = "| model | x |\n|---|---|\n| small: old | 1 |\n| medium: kept | 2 |\n"
    docs.write_text(f"intro\n{begin}\n{rows}{end}\nafter\n")
    monkeypatch.setattr(compare_trl, "DOC", docs)
    compare_trl.write_docs({compare_trl.TABLE: [("| small:", "| small: new | 3 |")]})
    text = docs.read_text()
    assert "| small: new | 3 |\n| medium: kept | 2 |" in text and "old" not in text
    assert text.startswith("intro\n") and text.endswith(f"{end}\nafter\n")
    compare_trl.write_docs({compare_trl.TABLE: [("| tiny:", "| tiny: added | 4 |")]})
    assert "| medium: kept | 2 |\n| tiny: added | 4 |\n" + end in docs.read_text()
    assert compare_trl.table_key("small", 1) == "| small, TRL on 1 thread:"
    assert compare_trl.table_key("medium", 2) == "| medium, TRL on 2 threads:"


def test_phases_come_from_the_logged_metrics_in_step_order() -> None:
    rows = [
        {"time/sync_weights_s": 0.1, "time/generate_s": 1.0, "time/reference_and_old_log_probs_s": 0.5}
        | {"time/advantages_s": 0.001, "time/actor_update_s": 2.0, "time/step_s": 3.6, "time/worker_compute_s": 3.0}
        | {"time/overhead_fraction": 0.2, "phase/generate/residency_s": 0.05}
    ]
    run = compare_trl.Run("roll", [3.6], rows, (1.0, 1.0))
    medians = run.phase_medians()
    order = ["sync_weights", "generate", "reference_and_old_log_probs", "advantages", "actor_update"]
    assert list(medians)[:5] == order
    assert medians["worker_compute"] == 3.0 and medians["offload/reload (all phases)"] == 0.05
    inline = compare_trl._phases_inline(run)
    assert inline == "sync_weights 0.10, generate 1.00, reference_and_old_log_probs 0.50, actor_update 2.00"


def test_one_ablation_holds_several_overrides_and_the_flag_repeats() -> None:
    layout = "devices_per_node=1 cpus_per_device=2 actor_train.device_mapping=0 'data.x=a b'"
    args, extra = compare_trl.build_parser().parse_known_args(
        ["--ablate", layout, "--ablate", "algorithm.old_log_probs_pass=always", "--no-trl", "seed=1"]
    )
    assert args.ablate == [layout, "algorithm.old_log_probs_pass=always"] and args.no_trl and extra == ["seed=1"]
    assert compare_trl.split_overrides(layout) == [
        "devices_per_node=1",
        "cpus_per_device=2",
        "actor_train.device_mapping=0",
        "data.x=a b",
    ]
    assert compare_trl.split_overrides(args.ablate[1]) == ["algorithm.old_log_probs_pass=always"]
    with pytest.raises(SystemExit, match="--ablate '  ' holds no override"):
        compare_trl.split_overrides("  ")
    with pytest.raises(SystemExit, match="--sft '' holds no override"):
        compare_trl.split_overrides("", "--sft")


def test_sft_and_pretrain_are_refused_together_before_anything_runs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        compare_trl.build_parser().parse_known_args(["--to-accuracy", "--sft", "max_steps=5", "--pretrain", "m"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_the_one_rank_two_thread_layout_trains_on_the_same_samples_per_optimizer_step(tmp_path: Path) -> None:
    model_dir, train_file, eval_file = compare_trl.build_inputs("small", tmp_path)
    layout = compare_trl.split_overrides(
        "devices_per_node=1 cpus_per_device=2 actor_train.device_mapping=0 actor_infer.device_mapping=0 "
        "reference.device_mapping=0 actor_train.training_args.gradient_accumulation_steps=2"
    )
    overrides = [*compare_trl.roll_overrides(model_dir, train_file, eval_file, 32, max_steps=5), *layout]
    register_schema_defaults("rlvr", RLVRConfig)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("rlvr_arithmetic", overrides=[*overrides, f"output_dir={tmp_path}"])
    config = load_pipeline_config(cfg, RLVRConfig, yaml_names([CONFIG_DIR]))
    args = config.actor_train.training_args
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps * config.actor_train.world_size == 128
    assert config.actor_train.devices == config.actor_infer.devices == config.reference.devices == [0]
    assert config.cpus_per_device == 2 and config.devices_per_node == 1


def test_to_accuracy_gives_trl_the_default_jobs_learning_settings(tmp_path: Path) -> None:
    from roll.models.tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "model")
    settings = compare_trl.shared_settings(compare_trl.default_job(model_dir, []))
    assert settings.prompts * settings.samples == 256 and settings.rows_per_update == 128
    assert settings.updates_per_step == 2 and settings.max_steps == 200 and settings.new_tokens == 6
    assert (settings.learning_rate, settings.kl_coef, settings.clip_low, settings.clip_high) == (5e-5, 1e-3, 0.2, 0.28)
    # A systems override changes nothing TRL is given; a learning one TRL is not configured for stops the benchmark.
    assert compare_trl.shared_settings(compare_trl.default_job(model_dir, ["actor_infer.infer_batch_size=64"])) == (
        settings
    )
    with pytest.raises(SystemExit, match=r"algorithm\.adv_estimator='grpo'"):
        compare_trl.shared_settings(compare_trl.default_job(model_dir, ["algorithm.adv_estimator=reinforce_plus_plus"]))
    train, held_out = compare_trl.write_task(compare_trl.default_job(model_dir, []).data, tmp_path)
    assert len(held_out.read_text().splitlines()) == 160 and len(train.read_text().splitlines()) == 640
    # The larger task: operands to 49, 1000 held-out problems (one evaluation's standard error at most 0.016).
    larger = compare_trl.default_job(model_dir, ["data.task_max_operand=49"]).data
    train, held_out = compare_trl.write_task(larger, tmp_path)
    assert len(held_out.read_text().splitlines()) == 1000 and len(train.read_text().splitlines()) == 4000
    assert '"prompt": "49-49="' in (train.read_text() + held_out.read_text())


def test_the_to_accuracy_report_times_every_side_to_the_first_sides_final_accuracy() -> None:
    from benchmarks.accuracy_curves import Point

    def curve(accuracies: list[float], seconds_per_step: float) -> list[Point]:
        return [
            Point(10 * i, a, 20 + 10 * i * seconds_per_step, 10 * i * seconds_per_step)
            for i, a in enumerate(accuracies)
        ]

    reference = [curve([0.4, 0.5, 0.6, 0.6, 0.6], 1.0)] * 2
    faster = [curve([0.4, 0.6, 0.6, 0.6, 0.6], 0.5)] * 2
    never = [curve([0.4, 0.4, 0.4, 0.4, 0.4], 0.5)] * 2
    settings = compare_trl.SharedSettings(32, 8, 6, 5e-5, 1e-3, 0.2, 0.28, 128, 40)
    report = compare_trl.to_accuracy_report(
        [("TRL", reference), ("roll", faster), ("roll `x=1`", never)], [1, 2], 160, settings
    )
    assert "Target: 0.600, TRL's final" in report
    # Smoothed over 3 evaluations, the reference first reaches 0.6 at step 40, the faster curve at step 30.
    assert "| TRL | 0.600, 0.600 | 1.00 | 40 | 60 | 40 |" in report
    assert "| roll | 0.600, 0.600 | 0.50 | 30 | 35 | 15 |" in report
    assert "| roll `x=1` | 0.400, 0.400 | 0.50 | not reached | - | - |" in report
    assert "TRL / roll: 1.71 in wall time from the command, 2.67 in training time." in report
    assert "| 10 | 0.500 (0.50, 0.50) | 0.600 (0.60, 0.60) | 0.400 (0.40, 0.40) |" in report
