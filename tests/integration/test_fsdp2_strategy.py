"""fsdp2_train against deepspeed_train at ZeRO-3, both on 2 CPU ranks over gloo: the same rows give the same losses.

One run per backend of the real actor (`ActorWorker`): three RLVR actor updates (the PPO loss, token-mean over the
global step, rows of different lengths on the two ranks), then three SFT updates, then the HF export. FSDP2's run
also saves a checkpoint after the RLVR updates and offloads its states to disk and back; one rank resumes from the
checkpoint. The same two backends then train LoRA adapters (PEFT) on the RLVR actor loss: the same losses, gradient
norms and merged export; FSDP2's LoRA run also checkpoints, offloads and resumes in between. Last, fsdp2_infer as a
2-rank reference: the log-probs and greedy samples plain transformers computes, through an offload round trip and a
weight load.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from roll.configs.algorithm_config import AlgorithmArguments
from roll.configs.worker_config import GeneratingArguments
from roll.distributed.executor.cluster import Cluster
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.scheduler.resource_manager import ResourceManager
from roll.distributed.strategy.hf_compute import generate_in_micro_batches, position_ids_from_mask
from roll.distributed.weight_sync.colocated import share_bucket
from roll.models.tiny import make_tiny_model
from roll.platforms import get_platform
from roll.utils.functionals import response_log_probs
from tests.conftest import CONFIG_DIR
from tests.integration.test_deepspeed_strategy import start_role
from tests.padded_rollouts import padded_rollout
from tests.worker_pool import HostPool

WORKER = "roll.pipeline.base.rl_workers.ActorWorker"
BLOCKS = {
    name: yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())[name]
    for name in ("deepspeed_zero3", "fsdp2", "fsdp2_cpuoffload")
}
BACKENDS = {"deepspeed_zero3": "deepspeed_train", "fsdp2": "fsdp2_train", "fsdp2_cpuoffload": "fsdp2_train"}
ALGORITHM = AlgorithmArguments(loss_agg_mode="token-mean")
pytestmark = pytest.mark.slow
# Rank 0 holds rows 0-7 and rank 1 rows 8-15, 4 of each a step: one rank with twice the accumulation sees the same
# 8 rows a step in this order.
SAME_STEPS_ON_ONE_RANK = [*range(0, 4), *range(8, 12), *range(4, 8), *range(12, 16)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def rollout() -> DataProto:
    """16 rollout rows; rank 0's 8 are short and rank 1's long, so the global-step normalisation matters."""
    prompt_lengths = [1, 2, 1, 3, 2, 1, 2, 1, 6, 5, 6, 4, 6, 5, 6, 3]
    response_lengths = [2, 1, 3, 1, 2, 4, 1, 2, 10, 9, 7, 10, 8, 10, 6, 9]
    tensors, generator = padded_rollout(prompt_lengths, response_lengths, (6, 10), vocab=60, seed=5)
    tensors["advantages"] = torch.randn(16, 10, generator=generator) * tensors["response_mask"]
    tensors["old_log_probs"] = -4.0 + 0.3 * torch.randn(16, 10, generator=generator)
    return DataProto.from_dict(tensors=tensors)


def start(
    pool: HostPool, manager: ResourceManager, model_path: str, block: str, offload_dir: str = "", **options
) -> Cluster:
    """The real actor on `block`'s backend (micro-batches of 2 rows; `options` as `start_role` takes them); with
    `offload_dir`, phase offloading moves its states to a spill file there."""
    return start_role(
        pool,
        manager,
        model_path,
        copy.deepcopy(BLOCKS[block]),
        strategy=BACKENDS[block],
        offload_dir=offload_dir,
        worker_cls=WORKER,
        role="actor_train",
        **options,
    )


def hf_log_probs(model_dir: str | Path, batch: DataProto) -> torch.Tensor:
    """The log-prob of each response token of `batch` under the model in `model_dir`, by plain transformers in fp32
    (all rows in one forward pass)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    input_ids, attention_mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask))
    return response_log_probs(logits.logits, input_ids, batch.batch["response_mask"].shape[1])


def global_loss(results: list[dict[str, float]]) -> float:
    """The loss every rank reports (the mean over the ranks)."""
    assert len({round(r["loss"], 12) for r in results}) == 1
    return results[0]["loss"]


@dataclass(frozen=True)
class Run:
    """One backend's losses (and the actor's gradient norms before clipping) on the same rows, and where its
    checkpoint and export went."""

    actor_losses: list[float]
    actor_grad_norms: list[float]
    sft_losses: list[float]
    export_dir: Path
    checkpoint_dir: Path


def run(pool: HostPool, manager: ResourceManager, model_path: str, rollout: DataProto, block: str, out: Path) -> Run:
    cluster = start(pool, manager, model_path, block, str(out / "spill") if block == "fsdp2" else "")
    try:
        actor = [cluster.train_step(rollout, ALGORITHM)[0] for _ in range(3)]
        if block == "fsdp2":
            assert cluster.save_checkpoint(str(out / "checkpoints"), "rl3") == [str(out / "checkpoints" / "rl3")] * 2
            offload_round_trip(cluster, rollout)
        sft = [global_loss(cluster.sft_step(rollout)) for _ in range(3)]
        cluster.export_hf(str(out / "hf"))
    finally:
        cluster.shutdown()
    return Run([m["loss"] for m in actor], [m["grad_norm"] for m in actor], sft, out / "hf", out / "checkpoints")


def offload_round_trip(cluster: Cluster, rollout: DataProto) -> None:
    """Offload every state to the spill file and back between the RLVR and SFT updates: the log-probs are bit for bit
    the same after, and the SFT updates that follow (AdamW's states included) still equal ZeRO-3's."""
    log_probs = cluster.compute_log_probs(rollout).batch["log_probs"]
    assert cluster.offload_moves_states() == [True, True]
    for metrics in cluster.offload_states():
        assert metrics["offload_states/offload/moved_bytes/model_params"] > 0
        assert metrics["offload_states/offload/moved_bytes/optimizer_states"] > 0
    for metrics in cluster.load_states():
        assert metrics["offload_states/reload/moved_bytes/optimizer_states"] > 0
    assert torch.equal(cluster.compute_log_probs(rollout).batch["log_probs"], log_probs)


@pytest.fixture(scope="module")
def runs(
    host_pool: HostPool,
    resource_manager: ResourceManager,
    model_path: str,
    rollout: DataProto,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Run]:
    return {
        block: run(host_pool, resource_manager, model_path, rollout, block, tmp_path_factory.mktemp(block))
        for block in ("deepspeed_zero3", "fsdp2")
    }


def test_rlvr_actor_and_sft_losses_equal_zero3(runs: dict[str, Run]) -> None:
    zero3, fsdp2 = runs["deepspeed_zero3"], runs["fsdp2"]
    assert fsdp2.actor_losses == pytest.approx(zero3.actor_losses, rel=1e-5)
    # Above max_grad_norm=1 in every call: the clipping is part of what must agree.
    assert fsdp2.actor_grad_norms == pytest.approx(zero3.actor_grad_norms, rel=1e-5)
    assert min(fsdp2.actor_grad_norms) > 1
    assert fsdp2.sft_losses == pytest.approx(zero3.sft_losses, rel=1e-5)
    assert fsdp2.sft_losses[-1] < fsdp2.sft_losses[0]  # it learns


def test_export_holds_the_trained_full_weights(runs: dict[str, Run], model_path: str) -> None:
    zero3, fsdp2 = (
        load_file(runs["deepspeed_zero3"].export_dir / "model.safetensors"),
        load_file(runs["fsdp2"].export_dir / "model.safetensors"),
    )
    original = load_file(Path(model_path) / "model.safetensors")
    assert fsdp2.keys() == zero3.keys() == original.keys()
    for name, tensor in fsdp2.items():
        assert tensor.shape == original[name].shape and tensor.dtype == original[name].dtype, name
        torch.testing.assert_close(tensor, zero3[name], atol=2e-4, rtol=1e-3, msg=name)
    assert not torch.equal(fsdp2["lm_head.weight"], original["lm_head.weight"])


def test_two_rank_checkpoint_resumes_on_one_rank(
    host_pool: HostPool, resource_manager: ResourceManager, model_path: str, rollout: DataProto, runs: dict[str, Run]
) -> None:
    """DCP reshards the 2-rank checkpoint for one rank, which keeps the global batch (2 x 4 x 1 = 2 x 2 x 2) and,
    with the rows reordered, sees in each optimizer step the rows the two ranks saw together."""
    cluster = start(host_pool, resource_manager, model_path, "fsdp2", devices="0", accumulation=4)
    try:
        cluster.load_checkpoint(str(runs["fsdp2"].checkpoint_dir))
        resumed = global_loss(cluster.sft_step(rollout[SAME_STEPS_ON_ONE_RANK]))
    finally:
        cluster.shutdown()
    assert resumed == pytest.approx(runs["fsdp2"].sft_losses[0], rel=1e-5)


def test_bf16_with_cpu_offload_and_checkpointing_follows_fp32(
    host_pool: HostPool, resource_manager: ResourceManager, model_path: str, rollout: DataProto, runs: dict[str, Run]
) -> None:
    """bf16 compute over fp32 shards (MixedPrecisionPolicy), the shards and AdamW in host memory (CPUOffloadPolicy)
    and recomputed activations: the fp32 run's actor losses within bf16's precision."""
    reason = get_platform("cpu").dtype_unsupported_reason("bf16")
    if reason:
        pytest.skip(f"this CPU has no bf16 support ({reason})")
    cluster = start(
        host_pool, resource_manager, model_path, "fsdp2_cpuoffload", dtype="bf16", gradient_checkpointing=True
    )
    try:
        losses = [global_loss(cluster.train_step(rollout, ALGORITHM)) for _ in range(3)]
    finally:
        cluster.shutdown()
    assert losses == pytest.approx(runs["fsdp2"].actor_losses, abs=2e-3)  # 3e-4 apart when written


@dataclass(frozen=True)
class LoraRun:
    """One backend's three RLVR actor updates of LoRA adapters, its log-probs after them and its merged export; FSDP2's
    run also holds the third update repeated after resuming from the checkpoint written before it."""

    actor_losses: list[float]
    actor_grad_norms: list[float]
    log_probs: torch.Tensor
    export_dir: Path
    resumed_loss: float | None


def lora_run(
    pool: HostPool, manager: ResourceManager, model_path: str, rollout: DataProto, block: str, out: Path
) -> LoraRun:
    """Rank-8 adapters on the attention projections. On FSDP2: a checkpoint after two updates, every state to the spill
    file and back, the third update, then the checkpoint loaded and the third update repeated before the export (so
    the export is also what the resumed run trained)."""
    fsdp2 = block == "fsdp2"
    cluster = start(pool, manager, model_path, block, str(out / "spill") if fsdp2 else "", lora_rank=8)
    try:
        actor = [cluster.train_step(rollout, ALGORITHM)[0] for _ in range(2)]
        if fsdp2:
            cluster.save_checkpoint(str(out / "checkpoints"), "lora2")
            offload_round_trip(cluster, rollout)
        actor.append(cluster.train_step(rollout, ALGORITHM)[0])
        resumed = None
        if fsdp2:
            cluster.load_checkpoint(str(out / "checkpoints"))
            resumed = cluster.train_step(rollout, ALGORITHM)[0]["loss"]
        log_probs = cluster.compute_log_probs(rollout).batch["log_probs"]
        cluster.export_hf(str(out / "hf"))
    finally:
        cluster.shutdown()
    return LoraRun([m["loss"] for m in actor], [m["grad_norm"] for m in actor], log_probs, out / "hf", resumed)


@pytest.fixture(scope="module")
def lora_runs(
    host_pool: HostPool,
    resource_manager: ResourceManager,
    model_path: str,
    rollout: DataProto,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, LoraRun]:
    """ZeRO-3 and FSDP2 each training LoRA adapters on the same rows."""
    return {
        block: lora_run(
            host_pool, resource_manager, model_path, rollout, block, tmp_path_factory.mktemp(f"lora_{block}")
        )
        for block in ("deepspeed_zero3", "fsdp2")
    }


def test_lora_losses_and_grad_norms_equal_zero3_and_resume(lora_runs: dict[str, LoraRun]) -> None:
    zero3, fsdp2 = lora_runs["deepspeed_zero3"], lora_runs["fsdp2"]
    assert fsdp2.actor_losses == pytest.approx(zero3.actor_losses, rel=1e-5)
    assert fsdp2.actor_grad_norms == pytest.approx(zero3.actor_grad_norms, rel=1e-5)
    assert len(set(fsdp2.actor_losses)) == 3  # the adapters change what each update computes
    # Model shards, adapters, AdamW's states, schedule and step all come back from the DCP checkpoint.
    assert fsdp2.resumed_loss == pytest.approx(fsdp2.actor_losses[2], rel=1e-6)


def test_lora_export_is_the_plain_model_with_merged_adapters(
    lora_runs: dict[str, LoraRun], model_path: str, rollout: DataProto
) -> None:
    """Only the adapted projections change; the merge equals DeepSpeed's and computes what the trainer computed."""
    zero3, fsdp2 = (
        load_file(lora_runs[block].export_dir / "model.safetensors") for block in ("deepspeed_zero3", "fsdp2")
    )
    original = load_file(Path(model_path) / "model.safetensors")
    assert not list(lora_runs["fsdp2"].export_dir.glob("adapter_*"))
    assert fsdp2.keys() == zero3.keys() == original.keys()
    changed = {name for name, tensor in fsdp2.items() if not torch.equal(tensor, original[name])}
    assert changed and all(
        name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")) for name in changed
    )
    for name, tensor in fsdp2.items():
        assert tensor.dtype == original[name].dtype, name
        torch.testing.assert_close(tensor, zero3[name], atol=2e-4, rtol=1e-3, msg=name)
    expected = hf_log_probs(lora_runs["fsdp2"].export_dir, rollout)
    mask = rollout.batch["response_mask"].bool()
    torch.testing.assert_close(expected[mask], lora_runs["fsdp2"].log_probs[mask], atol=1e-5, rtol=0)


def test_fsdp2_infer_reference_computes_what_transformers_computes(
    host_pool: HostPool,
    resource_manager: ResourceManager,
    model_path: str,
    rollout: DataProto,
    runs: dict[str, Run],
    tmp_path: Path,
) -> None:
    """fsdp2_infer on the CPU-offload block over 2 ranks as a reference: its log-probs and greedy samples are plain
    transformers' on the same rows (a sampled call also completes, the ranks in step); the shards go to the spill
    file and back bit for bit; and the full weights of the fsdp2 run's export, loaded as the colocated weight sync
    hands them over, give that export's log-probs."""
    cluster = start_role(
        host_pool,
        resource_manager,
        model_path,
        copy.deepcopy(BLOCKS["fsdp2_cpuoffload"]),
        strategy="fsdp2_infer",
        offload_dir=str(tmp_path / "spill"),
        worker_cls=WORKER,
        role="reference",
    )
    prompts = DataProto.from_dict(
        tensors={"input_ids": rollout.batch["prompts"], "attention_mask": rollout.batch["attention_mask"][:, :6]}
    )
    greedy_args = GeneratingArguments(max_new_tokens=5, do_sample=False)
    trained = dict(load_file(runs["fsdp2"].export_dir / "model.safetensors"))
    try:
        log_probs = cluster.compute_log_probs(rollout).batch["log_probs"]
        greedy = cluster.generate(prompts, greedy_args)
        sampled = cluster.generate(prompts, GeneratingArguments(max_new_tokens=5, num_return_sequences=2, seed=3))
        assert cluster.offload_moves_states() == [True, True]
        for metrics in cluster.offload_states():
            assert metrics["offload_states/offload/moved_bytes/model_params"] > 0
        for metrics in cluster.load_states():
            assert metrics["offload_states/reload/moved_bytes/model_params"] > 0
        reloaded = cluster.compute_log_probs(rollout).batch["log_probs"]
        shared, _buffer = share_bucket(list(trained.items()))
        loaded = sum(tensor.numel() * tensor.element_size() for tensor in trained.values())
        assert cluster.receive_colocated_bucket(shared) == [loaded, loaded]
        synced = cluster.compute_log_probs(rollout).batch["log_probs"]
    finally:
        cluster.shutdown()
    mask = rollout.batch["response_mask"].bool()
    # Both measured 0.0 on 2026-11-29 (fp32; the reference's micro-batches are 4 rows, transformers' one of 16).
    torch.testing.assert_close(log_probs[mask], hf_log_probs(model_path, rollout)[mask], atol=1e-6, rtol=0)
    assert torch.equal(reloaded, log_probs)
    torch.testing.assert_close(synced[mask], hf_log_probs(runs["fsdp2"].export_dir, rollout)[mask], atol=1e-6, rtol=0)
    assert (synced - log_probs)[mask].abs().max() > 1e-3  # the load changed what it computes
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    expected = generate_in_micro_batches(model, prompts, greedy_args, 4, "cpu")  # hf_infer's, 4 rows at a time
    assert torch.equal(greedy.batch["input_ids"], expected.output_ids)
    assert torch.equal(greedy.batch["response_mask"].sum(-1), expected.response_lengths)
    assert sampled.batch["input_ids"].shape == (32, 6 + 5)
