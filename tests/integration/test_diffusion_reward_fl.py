"""Reward FL on the real stack: Ray actors holding the diffusion model in DeepSpeed engines (gloo, CPU).

ZeRO stages agree on the first step's loss, offloading the engine's states and loading them back is
bit-exact, and a LoRA run resumed from a checkpoint repeats the losses of the uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from roll.distributed.executor.cluster import Cluster
from roll.distributed.scheduler.decorator import Dispatch, register
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.scheduler.resource_manager import ResourceManager
from roll.models.diffusion.parts import encode_prompts, load_diffusion_parts
from roll.pipeline.diffusion.diffusion_worker import RewardFLSettings, RewardFLWorker
from roll.pipeline.diffusion.prompts import prompt_splits
from roll.pipeline.diffusion.reward_fl_config import RewardFLConfig
from roll.pipeline.diffusion.reward_fl_pipeline import RewardFLPipeline
from roll.pipeline.diffusion.shapes import all_prompts
from roll.platforms import get_platform
from tests.pipeline_runs import run_pipeline
from tests.unit.test_hydra_configs import load_config
from tests.worker_pool import HostPool

pytestmark = pytest.mark.slow

TINY = "tiny-diffusion://unet?image_size=8&base_channels=8&text_hidden_size=16"
FAST = [
    "platform=cpu",
    "devices_per_node=2",
    "warm_start.base_model=''",
    "warm_start.output_dir=''",
    f"pretrain='{TINY}'",
    "batch_size=4",
    "max_steps=3",
    "eval_steps=3",
    "sampling.num_inference_steps=3",
    "sampling.grad_steps=2",
    "sampling.guidance_scale=2.0",
    "data.held_out_prompts=2",
    "data.eval_images_per_prompt=2",
    "actor.training_args.per_device_train_batch_size=4",
    "actor.training_args.learning_rate=1e-3",
]


class SnapshotWorker(RewardFLWorker):
    """The Reward FL worker, able to copy every state tensor its engine holds."""

    @register(Dispatch.ONE_TO_ALL)
    def snapshot(self) -> list[torch.Tensor]:
        """Copies of the module's parameters, the optimizer's master weights and its Adam moments."""
        engine = self.strategy.engine
        tensors = [p.detach().clone() for p in engine.module.parameters()]
        optimizer = engine.optimizer
        tensors += [t.detach().clone() for t in getattr(optimizer, "single_partition_of_fp32_groups", [])]
        inner = getattr(optimizer, "optimizer", optimizer)
        for state in inner.state.values():
            tensors += [v.detach().clone() for v in state.values() if torch.is_tensor(v)]
        return tensors


def actor_config(output: Path, *overrides: str) -> RewardFLConfig:
    return load_config("reward_fl_shapes", [*FAST, f"output_dir={output}", *overrides])


@pytest.fixture(scope="module")
def manager(ray_session: None) -> Iterator[ResourceManager]:
    resources = ResourceManager(get_platform("cpu"), num_nodes=1, devices_per_node=2, cpus_per_device=1)
    yield resources
    resources.destroy()


def start_actor(pool: HostPool, manager: ResourceManager, config: RewardFLConfig) -> Cluster:
    """The actor role of `config`, initialised, in pooled worker processes (tests/worker_pool.py)."""
    settings = RewardFLSettings(
        config.reward.name, {}, config.trainable_models, config.sampling, config.regulariser_weight, config.seed
    )
    cluster = pool.start(config.actor.worker_cls, config.actor, manager)
    cluster.initialize(settings)
    return cluster


def prompts_batch(count: int) -> DataProto:
    tokenizer = load_diffusion_parts(TINY).tokenizer
    return DataProto.from_dict(tensors=encode_prompts(tokenizer, prompt_splits(all_prompts(), 2)[0][:count]))


def test_zero_stages_give_the_same_first_step_loss(
    host_pool: HostPool, manager: ResourceManager, tmp_path: Path
) -> None:
    losses = {}
    for block in ("deepspeed_zero", "deepspeed_zero2", "deepspeed_zero3"):
        config = actor_config(
            tmp_path,
            "actor.device_mapping=0-1",
            "batch_size=8",
            f"actor.strategy_args.strategy_config=${{{block}}}",
        )
        cluster = start_actor(host_pool, manager, config)
        try:
            metrics = cluster.reward_fl_step(prompts_batch(8))
        finally:
            cluster.shutdown()
        assert metrics[0]["loss"] == pytest.approx(metrics[1]["loss"], rel=1e-12)  # both ranks report the mean
        losses[block] = metrics[0]["loss"]
    assert losses["deepspeed_zero"] != 0
    assert losses["deepspeed_zero2"] == pytest.approx(losses["deepspeed_zero"], rel=1e-5)
    assert losses["deepspeed_zero3"] == pytest.approx(losses["deepspeed_zero"], rel=1e-5)


def test_offload_and_reload_of_the_diffusion_states_is_bit_exact(
    host_pool: HostPool, manager: ResourceManager, tmp_path: Path
) -> None:
    # On a CPU host, offloading to host memory frees nothing and is skipped; to disk it moves every state.
    config = actor_config(
        tmp_path,
        "actor.worker_cls=tests.integration.test_diffusion_reward_fl.SnapshotWorker",
        "actor.strategy_args.offload_device=nvme",
        f"actor.strategy_args.offload_dir={tmp_path / 'offload'}",
    )
    cluster = start_actor(host_pool, manager, config)
    try:
        cluster.reward_fl_step(prompts_batch(4))
        before = cluster.snapshot()[0]
        assert all(cluster.offload_moves_states())
        moved = cluster.offload_states()[0]
        assert sum(value for key, value in moved.items() if "/moved_bytes/" in key) > 0, moved
        cluster.load_states()
        after = cluster.snapshot()[0]
        second = cluster.reward_fl_step(prompts_batch(4))[0]
    finally:
        cluster.shutdown()
    assert len(before) == len(after) > 0
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert second["loss"] == second["loss"]  # trains on after the reload (not NaN)


# LoRA adapters on the attention projections, a checkpoint after every step: one run for the two tests below.
LORA_RUN = (
    "actor.model_args.lora_rank=4",
    "actor.model_args.lora_target_modules=[to_q,to_k,to_v,to_out.0]",
    "actor.training_args.learning_rate=1e-2",
    "save_steps=1",
)


@pytest.fixture(scope="module")
def lora_run(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, list[dict]]:
    """A LORA_RUN of FAST's three steps: its output directory, summary and metrics rows."""
    output = tmp_path_factory.mktemp("lora_run")
    summary, rows = run_pipeline(RewardFLPipeline, actor_config(output, *LORA_RUN))
    return output, summary, rows


def test_resume_repeats_the_losses_of_the_uninterrupted_run(lora_run: tuple[Path, dict, list[dict]]) -> None:
    output, summary, rows = lora_run
    losses = {row["step"]: row["actor/loss"] for row in rows if "actor/loss" in row}
    assert sorted(losses) == [1, 2, 3]
    assert summary["val_distance_from_start_before"] == 0
    assert summary["val_distance_from_start_after"] > 0
    run_dir = output / "reward_fl"
    assert (run_dir / "logs" / "images_before.png").is_file() and (run_dir / "logs" / "images_after.png").is_file()
    _, resumed_rows = run_pipeline(RewardFLPipeline, actor_config(output, *LORA_RUN, "resume_from_checkpoint=step_1"))
    resumed = {row["step"]: row["actor/loss"] for row in resumed_rows if "actor/loss" in row}
    assert resumed[2] == pytest.approx(losses[2], rel=1e-6)
    assert resumed[3] == pytest.approx(losses[3], rel=1e-6)


def test_lora_trains_on_deepspeed_and_exports_a_plain_unet(lora_run: tuple[Path, dict, list[dict]]) -> None:
    model = lora_run[0] / "reward_fl" / "model"
    assert (model / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    exported = load_diffusion_parts(str(model)).unet.state_dict()  # the export is a diffusers directory
    base = load_diffusion_parts(TINY).unet.state_dict()
    assert sorted(exported) == sorted(base)  # LoRA merged: the plain UNet's names
    changed = {name for name in base if not torch.equal(exported[name], base[name])}
    targets = (".to_q.", ".to_k.", ".to_v.", ".to_out.0.")
    assert changed and all(any(target in name for target in targets) for name in changed), changed


def test_policy_gradient_trains_on_a_reward_without_gradient_at_zero3(ray_session: None, tmp_path: Path) -> None:
    """ZeRO-3 partitions the UNet: the update's log-probabilities call it outside the engine's forward pass."""
    config = actor_config(
        tmp_path,
        "algorithm=policy_gradient",
        "reward.name=compressibility",
        "regulariser_weight=0",
        "batch_size=2",
        "policy.group_size=2",
        "max_steps=2",
        "eval_steps=2",
        "actor.strategy_args.strategy_config=${deepspeed_zero3}",
    )
    summary, rows = run_pipeline(RewardFLPipeline, config)
    first = rows[1]
    assert first["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # the rollout's own policy: ratio 1
    assert first["actor/grad_norm"] > 0 and first["actor/reward"] < 0  # minus kilobytes
    assert first["time/rollout_s"] > 0 and first["time/policy_update_s"] > 0
    assert summary["val_distance_from_start_after"] > 0
    # The whole UNet trained, partitioned: its export gathers every weight into a plain diffusers directory.
    exported = load_diffusion_parts(str(tmp_path / "reward_fl" / "model")).unet.state_dict()
    base = load_diffusion_parts(TINY).unet.state_dict()
    assert sorted(exported) == sorted(base)
    assert any(not torch.equal(exported[name], base[name]) for name in base)
