"""RLVR and SFT end to end with actor_train on fsdp2_train, swapped in by the overrides a user writes, and its weight
sync on both routes (full weights, and LoRA adapters merged)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.scheduler.resource_manager import ResourceManager
from roll.models.model_providers import load_tokenizer
from roll.models.tiny import make_tiny_model
from roll.pipeline.sft.sft_pipeline import SFTPipeline
from roll.platforms import get_platform
from tests.integration.test_weight_sync_e2e import GREEDY, log_probs, role, started, syncer, train_step
from tests.pipeline_runs import run_pipeline
from tests.rlvr_runs import PARITY_REWARD, arithmetic_config, block, run_rlvr
from tests.unit.test_hydra_configs import load_config
from tests.worker_pool import HostPool

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


@pytest.mark.parametrize("lora_rank", [0, 8])
def test_weights_stream_from_the_shards_on_either_route(host_pool: HostPool, tmp_path: Path, lora_rank: int) -> None:
    """The trainer's full weights, gathered from its shards (with LoRA: the adapters merged into them), reach an
    hf_infer role on its devices in memory and over a forced broadcast: after each sync it computes what the trainer
    computes (and the trainer's own synced generation gives the samples)."""
    model_path = str(make_tiny_model(tmp_path / "tiny"))
    encoded = load_tokenizer(model_path)([f"{a}+{b * 3}=" for a in range(4) for b in range(2)], padding=True)
    prompts = DataProto.from_dict(tensors={k: torch.tensor(encoded[k]) for k in ("input_ids", "attention_mask")})
    manager = ResourceManager(get_platform("cpu"), num_nodes=1, devices_per_node=3, cpus_per_device=1)
    configs = {
        "actor_train": role("actor_train", "fsdp2_train", "0-1", model_path, {}),
        "hf_infer": role("hf_infer", "hf_infer", "0-1", model_path),
    }
    configs["actor_train"].model_args.lora_rank = lora_rank
    with started(configs, manager, host_pool) as roles:
        for method, route in (("auto", "sync/colocated_bytes"), ("broadcast", "sync/broadcast_bytes")):
            train_step(roles, prompts)
            expected = roles["actor_train"].generate(prompts, GREEDY)
            trainer_log_probs = log_probs(roles["actor_train"], expected)
            assert (log_probs(roles["hf_infer"], expected) - trainer_log_probs).abs().max() > 1e-3
            assert syncer(roles, "hf_infer", method).sync()[route] > 0, method
            torch.testing.assert_close(log_probs(roles["hf_infer"], expected), trainer_log_probs, rtol=0, atol=1e-5)
