"""The DPO pipeline end to end on the real stack: Ray, a DeepSpeed policy, an hf_infer reference, HF export.

Its run is also the thorough check of the step-by-step training loop's resume (roll/pipeline/base/training_loop.py),
which distillation and the reward model share; Reward FL restarts a run of its own for its step-seeded noise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from roll.pipeline.dpo.dpo_config import DPOConfig
from roll.pipeline.dpo.dpo_pipeline import DPOPipeline
from tests.pipeline_runs import run_pipeline
from tests.unit.test_hydra_configs import load_config

pytestmark = pytest.mark.slow

# Two steps of 8 pairs on a tiny untrained model, a checkpoint after each, 16 held-out pairs, policy and reference
# one rank each on one shared device (test_rm_pipeline.py's pairwise run is the two-rank one). The policy runs
# ZeRO-3 (the YAML's is ZeRO-2; the RM and distillation tests swap in other blocks): the block swaps as everywhere.
FAST = [
    "pretrain=tiny://qwen2",
    "actor_train.strategy_args.strategy_config=${deepspeed_zero3}",
    "batch_size=8",
    "eval_batch_size=16",
    "max_steps=2",
    "eval_steps=2",
    "save_steps=1",
    "actor_train.training_args.per_device_train_batch_size=16",  # 8 pairs: 16 rows
    "actor_train.training_args.warmup_steps=0",
    "actor_train.device_mapping=0",
    "reference.device_mapping=0",
    "devices_per_node=1",
    "platform=cpu",
]


def make_config(output: Path, *overrides: str) -> DPOConfig:
    return load_config("dpo_arithmetic", [*FAST, f"output_dir={output}", *overrides])


def run(config: DPOConfig) -> tuple[dict, list[dict]]:
    return run_pipeline(DPOPipeline, config)


def test_two_steps_log_metrics_checkpoint_export_and_resume(ray_session: None, tmp_path: Path) -> None:
    # On CPU only offloading to disk moves anything (host memory is where the states already are).
    spill = [f"actor_train.strategy_args.{k}" for k in ("offload_device=nvme", f"offload_dir={tmp_path / 'spill'}")]
    summary, rows = run(make_config(tmp_path, *spill))
    assert [row["step"] for row in rows] == [0, 1, 2]
    first_step = rows[1]
    for key in ("actor/loss", "actor/rewards/chosen", "actor/rewards/rejected", "actor/rewards/accuracy"):
        assert key in first_step, key
    # Step 1 starts from the reference's weights: every implicit reward is 0 and the loss is log 2.
    assert first_step["actor/loss"] == pytest.approx(0.6931, abs=1e-3)
    assert abs(first_step["actor/rewards/margin"]) < 1e-4
    # The policy shares the reference's devices: its states go to disk while the reference scores, and come back.
    assert first_step["phase/actor_update/bytes_moved"] > 0
    assert rows[2]["actor/rewards/margin"] != 0 and 0 <= rows[2]["val/preference_accuracy"] <= 1
    assert rows[0]["val/preference_accuracy"] == pytest.approx(0.5, abs=0.1)  # policy = reference: ties count half
    assert summary["val_preference_accuracy_after"] == rows[2]["val/preference_accuracy"]

    run_dir = tmp_path / "dpo"
    for step in (1, 2):
        assert (run_dir / "checkpoints" / f"step_{step}" / "driver_state.json").is_file()
    assert list((run_dir / "logs" / "tensorboard").glob("events.out.tfevents.*"))
    assert {p.name for p in (run_dir / "logs").glob("*.png")} == {"preference_accuracy.png", "reward_margin.png"}
    export = run_dir / "model"
    model = AutoModelForCausalLM.from_pretrained(export)
    tokenizer = AutoTokenizer.from_pretrained(export)
    ids = tokenizer("1+2=", return_tensors="pt").input_ids
    assert torch.isfinite(model(ids).logits).all()

    # Resuming from step 1 replays step 2 from the same weights, optimizer state and data position (its states
    # spilled to disk and back again meanwhile); the rows logged up to the checkpoint are kept as they were.
    resumed_summary, resumed = run(make_config(tmp_path, *spill, "resume_from_checkpoint=step_1"))
    assert [row["step"] for row in resumed] == [0, 1, 2]
    assert resumed[:2] == rows[:2]
    for key in ("actor/loss", "actor/rewards/chosen", "actor/rewards/rejected", "val/preference_accuracy"):
        assert resumed[2][key] == pytest.approx(rows[2][key], rel=1e-4), key
    assert resumed_summary["val_preference_accuracy_before"] == rows[0]["val/preference_accuracy"]


def test_kto_on_unpaired_completions_weights_each_class(ray_session: None, tmp_path: Path) -> None:
    """Two KTO steps of 8 labelled completions, one rank per role: step 1 starts at the reference (every reward
    and z0 are 0), so its loss is the class weights' average of 1 - sigmoid(0) = 0.5."""
    overrides = [
        "loss.loss_type=kto",
        "data.format=unpaired",
        "loss.kto_desirable_weight=2.0",
        "save_steps=0",
        "actor_train.training_args.per_device_train_batch_size=8",  # 8 completions: 8 rows
    ]
    summary, rows = run(make_config(tmp_path, *overrides))
    assert [row["step"] for row in rows] == [0, 1, 2]
    first, second = rows[1], rows[2]
    desirable, undesirable = first["actor/kto/desirable_rows"], first["actor/kto/undesirable_rows"]
    assert desirable + undesirable == 8 and desirable > 0 and undesirable > 0
    assert first["actor/loss"] == pytest.approx((2 * 0.5 * desirable + 0.5 * undesirable) / 8, abs=1e-4)
    assert first["actor/kto/reference_point"] == 0 and abs(first["actor/kto/mismatched_log_ratio"]) < 1e-4
    assert abs(first["actor/rewards/margin"]) < 1e-4 and second["actor/rewards/margin"] != 0
    assert rows[0]["val/preference_accuracy"] == 0.5  # policy = reference: every (desirable, undesirable) pair ties
    assert summary["val_preference_accuracy_after"] == second["val/preference_accuracy"]
    assert (tmp_path / "dpo" / "model" / "model.safetensors").is_file()
