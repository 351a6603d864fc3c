"""Flow-matching models in `roll-reward-fl` on the real stack: Ray actors holding tiny SD3 / Wan pipelines in
DeepSpeed engines (gloo, CPU).

One Reward FL run on the video model (ZeRO-2) serves several checks (its losses, held-out reward, image grids
and GIFs, the export as a diffusers Wan pipeline); Flow-GRPO and DiffusionNFT each take one step on the image
model at ZeRO-3, on one rank. On two ranks in the pooled worker processes (tests/worker_pool.py), ZeRO 0, 2 and 3
give the image model's first Reward FL step one loss.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.scheduler.resource_manager import ResourceManager
from roll.models.diffusion.flow_parts import load_flow_parts
from roll.models.diffusion.parts import encode_prompts
from roll.models.diffusion.tiny_diffusion import resolve_diffusion_path
from roll.pipeline.diffusion.diffusion_worker import RewardFLSettings
from roll.pipeline.diffusion.prompts import prompt_splits
from roll.pipeline.diffusion.reward_fl_config import RewardFLConfig
from roll.pipeline.diffusion.reward_fl_pipeline import RewardFLPipeline
from roll.pipeline.diffusion.shapes import all_prompts
from tests.pipeline_runs import run_pipeline
from tests.unit.test_hydra_configs import load_config
from tests.worker_pool import HostPool

pytestmark = pytest.mark.slow

SD3 = "tiny-diffusion://sd3?image_size=8&layers=1&head_dim=8&text_hidden_size=8"
WAN = "tiny-diffusion://wan?image_size=8&frames=3&layers=1&head_dim=8&text_hidden_size=8"
FAST = [
    "platform=cpu",
    "devices_per_node=2",
    "warm_start.base_model=''",
    "warm_start.output_dir=''",
    "batch_size=4",
    "max_steps=2",
    "eval_steps=2",
    "sampling.num_inference_steps=3",
    "sampling.grad_steps=2",
    "sampling.guidance_scale=2.0",
    "flow.rollout_steps=2",
    "data.held_out_prompts=2",
    "data.eval_images_per_prompt=2",
    "actor.training_args.per_device_train_batch_size=4",
    "actor.training_args.learning_rate=1e-3",
]


def flow_config(output: Path, yaml: str, model: str, *overrides: str) -> RewardFLConfig:
    return load_config(yaml, [*FAST, f"pretrain='{model}'", f"output_dir={output}", *overrides])


@pytest.fixture(scope="module")
def video_run(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, list[dict]]:
    """Two Reward FL steps on the tiny Wan model: its run directory, summary and metrics rows."""
    output = tmp_path_factory.mktemp("flow_video")
    config = flow_config(output, "reward_fl_flow_video", WAN, "flow.image_size=8", "flow.frames=3")
    summary, rows = run_pipeline(RewardFLPipeline, config)
    return output / config.exp_name, summary, rows


def test_reward_fl_on_video_trains_and_writes_grids_and_gifs(video_run: tuple[Path, dict, list[dict]]) -> None:
    run_dir, summary, rows = video_run
    steps = {row["step"]: row for row in rows if "actor/loss" in row}
    assert sorted(steps) == [1, 2]
    assert steps[1]["actor/regulariser"] == 0  # the trained transformer starts as the frozen one
    assert steps[2]["actor/regulariser"] > 0 and steps[1]["actor/grad_norm"] > 0
    assert summary["val_distance_from_start_before"] == 0 < summary["val_distance_from_start_after"]
    for name in ("images_before.png", "images_after.png", "images_before.gif", "images_after.gif"):
        assert (run_dir / "logs" / name).is_file(), name
    from PIL import Image

    assert Image.open(run_dir / "logs" / "images_after.gif").n_frames == 3


def test_the_video_export_is_a_wan_pipeline_with_a_trained_transformer(
    video_run: tuple[Path, dict, list[dict]],
) -> None:
    exported = load_flow_parts(str(video_run[0] / "model"))
    assert type(exported.pipeline).__name__ == "WanPipeline" and exported.family == "video"
    base = load_flow_parts(WAN).transformer.state_dict()
    trained = exported.transformer.state_dict()
    assert sorted(trained) == sorted(base)
    assert any(not torch.equal(trained[name], base[name]) for name in base)


@pytest.mark.parametrize("algorithm", ["flow_grpo", "diffusion_nft"])
def test_flow_policy_algorithms_take_a_step_at_zero3(ray_session: None, tmp_path: Path, algorithm: str) -> None:
    """ZeRO-3 partitions the transformer: the update calls it outside the engine's forward pass."""
    config = flow_config(
        tmp_path,
        "reward_fl_flow_shapes",
        SD3,
        f"algorithm={algorithm}",
        "regulariser_weight=0",
        "batch_size=2",
        "policy.group_size=2",
        "max_steps=1",
        "eval_steps=1",
        "actor.strategy_args.strategy_config=${deepspeed_zero3}",
    )
    summary, rows = run_pipeline(RewardFLPipeline, config)
    first = next(row for row in rows if "actor/loss" in row)
    assert first["actor/grad_norm"] > 0 and first["time/rollout_s"] > 0 and first["time/policy_update_s"] > 0
    if algorithm == "flow_grpo":
        assert first["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # the rollout's own policy
    else:
        assert first["actor/nft_loss"] > 0
    assert summary["val_distance_from_start_after"] > 0


def test_zero_stages_give_the_same_first_step_loss_on_two_ranks(
    host_pool: HostPool, resource_manager: ResourceManager, tmp_path: Path
) -> None:
    """ZeRO 0, 2 and 3 one after another in the same two pooled processes: one Reward FL loss on both ranks. At
    ZeRO-3 each rank loads the text encoders collectively, in an order that once followed its string hashes; the
    export then holds the frozen parts whole."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_diffusion_path(SD3), subfolder="tokenizer")
    prompts = DataProto.from_dict(tensors=encode_prompts(tokenizer, prompt_splits(all_prompts(), 2)[0][:4]))
    losses = {}
    for block in ("deepspeed_zero", "deepspeed_zero2", "deepspeed_zero3"):
        config = flow_config(
            tmp_path,
            "reward_fl_flow_shapes",
            SD3,
            "actor.device_mapping=0-1",
            "actor.training_args.per_device_train_batch_size=2",
            f"actor.strategy_args.strategy_config=${{{block}}}",
        )
        settings = RewardFLSettings(
            config.reward.name, {}, config.trainable_models, config.sampling, config.regulariser_weight, config.seed
        )
        cluster = host_pool.start(config.actor.worker_cls, config.actor, resource_manager)
        try:
            cluster.initialize(settings)
            losses[block] = [metrics["loss"] for metrics in cluster.reward_fl_step(prompts)]
            if block == "deepspeed_zero3":  # every part partitioned: the export writes them from gathered weights
                cluster.export_hf(str(tmp_path / "export"))
        finally:
            cluster.shutdown()
    assert losses["deepspeed_zero"][0] != 0
    for block, per_rank in losses.items():
        assert per_rank == pytest.approx([losses["deepspeed_zero"][0]] * 2, rel=1e-6), (block, losses)
    source, exported = load_flow_parts(SD3).pipeline, load_flow_parts(str(tmp_path / "export")).pipeline
    for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"):  # frozen: as loaded
        expected, written = source.components[name].state_dict(), exported.components[name].state_dict()
        assert all(torch.equal(written[key], tensor) for key, tensor in expected.items()), name
