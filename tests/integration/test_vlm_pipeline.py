"""The vision-language recipes end to end on the real stack: the SFT warm start of tiny://qwen2_5_vl on the framed-
square colour task, then GRPO from its export (Ray, DeepSpeed ZeRO-2 with the vision tower trained, then frozen,
hf_infer generation from image prompts, an hf_infer reference, the weight sync, the exports)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from roll.pipeline.rlvr.rlvr_pipeline import RLVRPipeline
from roll.pipeline.sft.sft_pipeline import SFTPipeline
from tests.pipeline_runs import run_pipeline
from tests.unit.test_hydra_configs import load_config

pytestmark = pytest.mark.slow


def test_sft_then_grpo_on_pictures(ray_session: None, tmp_path: Path) -> None:
    """Two SFT steps, then two GRPO steps from the export: every pass ran on the image rows, the vision tower
    trained in SFT and stayed as it was through GRPO (frozen), the decoder changed, and both exports carry the
    processor."""
    output = f"output_dir={tmp_path}"
    sft = load_config("sft_vlm_colour", [output, "max_steps=2", "eval_steps=2"])
    run_pipeline(SFTPipeline, sft)
    sft_export = Path(sft.model_export_dir)
    for name in ("processor_config.json", "chat_template.jinja", "tokenizer.json", "model.safetensors"):
        assert (sft_export / name).is_file(), name

    # A reward two samples of a barely trained model disagree on, so that GRPO's update has a signal.
    parity = "rewards.math.reward_fn=tests.reward_functions.parity_reward"
    fast = ["max_steps=2", "eval_steps=2", "rollout_batch_size=8", "eval_batch_size=32", parity]
    rlvr = load_config("rlvr_vlm_colour", [output, *fast, "actor_train.training_args.per_device_train_batch_size=16"])
    summary, rows = run_pipeline(RLVRPipeline, rlvr)
    assert [row["step"] for row in rows if "actor/loss" in row] == [1, 2]
    step = next(row for row in rows if row.get("step") == 1)
    for key in ("actor/loss", "actor/kl", "critic/advantages_mean"):
        assert key in step, key
    assert 0 <= summary["val_accuracy_after"] <= 1

    rlvr_export = Path(rlvr.model_export_dir)
    before, after = load_file(sft_export / "model.safetensors"), load_file(rlvr_export / "model.safetensors")
    visual = [name for name in before if ".visual." in name]
    assert visual and all(torch.equal(before[name], after[name]) for name in visual)
    assert not torch.equal(before["lm_head.weight"], after["lm_head.weight"])
    assert (rlvr_export / "processor_config.json").is_file()
