"""RLVR and SFT end to end with actor_train on fsdp2_train, swapped in by the overrides a user writes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from roll.pipeline.sft.sft_pipeline import SFTPipeline
from tests.pipeline_runs import run_pipeline
from tests.rlvr_runs import PARITY_REWARD, arithmetic_config, block, run_rlvr
from tests.unit.test_hydra_configs import load_config

pytestmark = pytest.mark.slow
FSDP2 = ("actor_train.strategy_args.strategy_name=fsdp2_train", block("fsdp2"))


def test_rlvr_trains_and_syncs_weights_from_fsdp2(ray_session: None, tmp_path: Path) -> None:
    """Two steps on both device slots: the actor's shards stream to actor_infer (in the same processes), it learns
    from a varying reward, and the step-2 checkpoint is complete."""
    rows = run_rlvr(arithmetic_config(tmp_path, "max_steps=2", "eval_steps=2", "save_steps=2", PARITY_REWARD, *FSDP2))
    assert [row["step"] for row in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert math.isfinite(row["actor/loss"]) and row["actor/grad_norm"] > 0
    assert rows[2]["sync/colocated_bytes"] > 0  # step 1's update, before step 2 generates
    checkpoints = tmp_path / "rlvr" / "checkpoints"
    assert (checkpoints / "step_2" / "driver_state.json").is_file()
    assert (checkpoints / "actor_train" / "step_2" / "roll_checkpoint.json").is_file()


def test_sft_trains_and_exports_from_fsdp2(ray_session: None, tmp_path: Path) -> None:
    """One rank (a one-rank mesh), two steps: the export loads in transformers with the trained weights."""
    one_rank = ("devices_per_node=1", "actor_train.device_mapping=0", "batch_size=32")
    config = load_config(
        "sft_arithmetic",
        ["platform=cpu", "max_steps=2", "eval_steps=2", *one_rank, f"output_dir={tmp_path}", *FSDP2],
    )
    _, rows = run_pipeline(SFTPipeline, config)
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == 2 and losses[1] < losses[0]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "sft" / "model")
    assert type(exported).__name__ == "Qwen2ForCausalLM"
