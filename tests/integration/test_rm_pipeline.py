"""The reward-model pipeline end to end (Ray, DeepSpeed ZeRO-2, HF export), then its export as RLVR's reward cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

from roll.algorithms.process_reward_losses import step_rewards
from roll.datasets.preference_dataset import encode_pairs, load_preference_splits
from roll.datasets.step_dataset import encode_steps, load_step_splits
from roll.distributed.strategy.hf_compute import position_ids_from_mask
from roll.models.model_providers import load_tokenizer
from roll.pipeline.rlvr.rlvr_config import PROCESS_REWARD_SCORING_WORKER, REWARD_MODEL_WORKER
from roll.pipeline.rlvr.rlvr_pipeline import RLVRPipeline
from roll.pipeline.rm.rm_config import RMConfig
from roll.pipeline.rm.rm_pipeline import RMPipeline
from tests.pipeline_runs import logged_metrics, run_pipeline
from tests.rlvr_runs import ONE_RANK, arithmetic_config
from tests.unit.test_hydra_configs import load_config

pytestmark = pytest.mark.slow

# Two steps of 8 pairs on a tiny untrained model, a checkpoint after each, 16 held-out pairs, at ZeRO stage 0
# (the YAML's block is ZeRO-2), on two ranks: the preference pipelines' data-parallel run (DPO's runs on one).
FAST = [
    "pretrain=tiny://qwen2",
    "reward_model.strategy_args.strategy_config=${deepspeed_zero}",
    "batch_size=8",
    "eval_batch_size=16",
    "max_steps=2",
    "eval_steps=2",
    "save_steps=1",
    "reward_model.training_args.per_device_train_batch_size=8",
    "reward_model.training_args.warmup_steps=0",
    "devices_per_node=2",
    "platform=cpu",
]


def make_config(output: Path, *overrides: str) -> RMConfig:
    return load_config("rm_arithmetic", [*FAST, f"output_dir={output}", *overrides])


def test_train_export_and_score_rlvr_rollouts_with_the_reward_model(ray_session: None, tmp_path: Path) -> None:
    config = make_config(tmp_path)
    summary, rows = run_pipeline(RMPipeline, config)
    run_dir = tmp_path / "rm"
    assert [row["step"] for row in rows] == [0, 1, 2]
    for key in ("loss", "accuracy", "rewards/chosen", "rewards/rejected", "rewards/margin", "grad_norm"):
        assert f"reward_model/{key}" in rows[1] and f"reward_model/{key}" in rows[2], key
    first = rows[1]
    assert first["reward_model/loss"] > 0 and 0 <= first["reward_model/accuracy"] <= 1
    margin = first["reward_model/rewards/chosen"] - first["reward_model/rewards/rejected"]
    assert first["reward_model/rewards/margin"] == pytest.approx(margin, abs=1e-5)
    assert summary["val_pairwise_accuracy_after"] == rows[2]["val/preference_accuracy"]
    for step in (1, 2):
        assert (run_dir / "checkpoints" / f"step_{step}" / "driver_state.json").is_file()
    assert list((run_dir / "logs" / "tensorboard").glob("events.out.tfevents.*"))

    export = run_dir / "model"
    model = AutoModelForSequenceClassification.from_pretrained(export).eval()
    assert model.config.num_labels == 1

    # RLVR with the export as its reward cluster (device-less, hf_infer): one step, scores from the model.
    rlvr_config = arithmetic_config(
        tmp_path,
        *ONE_RANK,
        "max_steps=1",
        "eval_steps=100",
        "eval_batch_size=8",
        "num_log_samples=8",
        f"rewards.math.worker_cls={REWARD_MODEL_WORKER}",
        f"rewards.math.model_args.model_name_or_path={export}",
        "rewards.math.strategy_args.strategy_name=hf_infer",
        "rewards.math.model_args.dtype=fp32",
    )
    tokenizer = load_tokenizer(str(export))
    _, held_out = load_preference_splits(config.data, tokenizer, config.max_response_length)
    batch = encode_pairs(held_out[:6], tokenizer.pad_token_id)
    rlvr = RLVRPipeline(rlvr_config)
    try:
        served = rlvr.score(batch)
        rlvr.run()
    finally:
        rlvr.shutdown()
    with torch.no_grad():
        direct = model(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"]).logits[:, 0]
    assert served.tolist() == pytest.approx(direct.tolist(), abs=1e-5)
    assert served.std() > 0

    logs = tmp_path / "rlvr" / "logs"
    steps = logged_metrics(tmp_path / "rlvr")
    assert steps[-1]["step"] == 1 and steps[-1]["rollout/reward_failed"] == 0
    scores = [json.loads(line)["score"] for line in (logs / "samples.jsonl").read_text().splitlines()]
    assert len(set(scores)) > 2  # a reward model's real-valued scores, not a verifier's 0/1


def test_process_reward_model_trains_on_step_labels_and_exports_a_score_per_token(
    ray_session: None, tmp_path: Path
) -> None:
    """Two steps of 8 step-labelled responses on one rank; the export scores every token (token classification),
    then serves as RLVR's reward: step rewards where the training data marks step ends, one REINFORCE++ step."""
    overrides = [
        "pretrain=tiny://qwen2",
        "batch_size=8",
        "eval_batch_size=16",
        "max_steps=2",
        "eval_steps=2",
        "reward_model.training_args.per_device_train_batch_size=8",
        "reward_model.training_args.warmup_steps=0",
        "reward_model.device_mapping=0",
        "devices_per_node=1",
        "platform=cpu",
        f"output_dir={tmp_path}",
    ]
    config = load_config("rm_prm_arithmetic", overrides)
    summary, rows = run_pipeline(RMPipeline, config)
    run_dir = tmp_path / "prm"
    assert [row["step"] for row in rows] == [0, 1, 2]
    for key in ("loss", "step_accuracy", "step_score", "grad_norm"):
        assert f"reward_model/{key}" in rows[1], key
    assert 0.3 < rows[1]["reward_model/loss"] < 1.5  # BCE of a fresh head near log 2, not a pairwise loss
    assert rows[0]["val/step_loss"] > 0 and 0 <= rows[2]["val/first_error_found"] <= 1
    assert summary["val_step_accuracy_after"] == rows[2]["val/step_accuracy"]
    assert (run_dir / "logs" / "step_accuracy.png").is_file()

    export = run_dir / "model"
    tokenizer = load_tokenizer(str(export))
    _, held_out = load_step_splits(config.data, tokenizer, config.max_response_length)
    row = held_out[0]
    ids = torch.tensor([[*row.example.prompt_ids, *row.example.response_ids]])
    model = AutoModelForTokenClassification.from_pretrained(export).eval()
    assert model.config.num_labels == 1
    with torch.no_grad():
        steps = model(input_ids=ids).logits[0, :, 0]
    ends = [len(row.example.prompt_ids) + end for end in row.step_ends]
    assert ends[-1] == ids.shape[1] - 1 and steps[ends[0]] != steps[ends[1]]  # a score per step

    rlvr_config = arithmetic_config(
        tmp_path,
        *ONE_RANK,
        "max_steps=1",
        "eval_steps=100",
        "eval_batch_size=8",
        "num_log_samples=8",
        "data.task=two_step_arithmetic",
        "actor_infer.generating_args.max_new_tokens=8",
        "algorithm.adv_estimator=reinforce_plus_plus",
        f"rewards.math.worker_cls={PROCESS_REWARD_SCORING_WORKER}",
        f"rewards.math.model_args.model_name_or_path={export}",
        "rewards.math.strategy_args.strategy_name=hf_infer",
        "rewards.math.model_args.dtype=fp32",
    )
    batch = encode_steps(held_out[:4], tokenizer.pad_token_id)
    rlvr = RLVRPipeline(rlvr_config)
    try:
        served = rlvr.clusters["rewards.math"].compute_rewards(batch).batch
        rlvr.run()
    finally:
        rlvr.shutdown()
    mask, step_mask = batch.batch["attention_mask"], batch.batch["step_mask"]
    with torch.no_grad():
        output = model(
            input_ids=batch.batch["input_ids"], attention_mask=mask, position_ids=position_ids_from_mask(mask)
        )
    direct = step_rewards(output.logits[:, -step_mask.shape[1] :, 0], step_mask, "min")
    torch.testing.assert_close(served["turn_rewards"], direct, atol=1e-5, rtol=0)
    torch.testing.assert_close(served["scores"], direct.sum(-1), atol=1e-5, rtol=0)
    steps = logged_metrics(tmp_path / "rlvr")
    assert steps[-1]["step"] == 1 and steps[-1]["rollout/reward_failed"] == 0 and "actor/loss" in steps[-1]
