"""deepspeed_train and deepspeed_infer on 2 CPU ranks over gloo, with real DeepSpeed."""

from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, GenerationConfig

from roll.configs.worker_config import (
    GeneratingArguments,
    ModelArguments,
    StrategyArguments,
    TrainingArguments,
    WorkerConfig,
)
from roll.distributed.executor.cluster import Cluster
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.scheduler.resource_manager import ResourceManager
from roll.distributed.strategy.hf_compute import generate_in_micro_batches
from roll.models.model_providers import load_tokenizer
from roll.models.tiny import TinyModelSpec, make_tiny_model
from roll.platforms import get_platform
from tests.conftest import CONFIG_DIR
from tests.strategy_workers import next_token_log_probs
from tests.worker_pool import HostPool

WORKER = "tests.strategy_workers.StrategyWorker"
BLOCKS = {p.stem: yaml.safe_load(p.read_text())[p.stem] for p in sorted(CONFIG_DIR.glob("deepspeed_zero*.yaml"))}
pytestmark = pytest.mark.slow
# Rank 0 holds rows 0-7 and rank 1 rows 8-15, and each optimizer step takes 4 of each: in this order one rank with
# twice the accumulation sees the same 8 rows a step.
SAME_STEPS_ON_ONE_RANK = [*range(0, 4), *range(8, 12), *range(4, 8), *range(12, 16)]


def zero_block(stage: int) -> dict:
    """The examples/config block of a stage (no offload)."""
    return copy.deepcopy(
        BLOCKS[{0: "deepspeed_zero", 1: "deepspeed_zero2", 2: "deepspeed_zero2", 3: "deepspeed_zero3"}[stage]]
    ) | ({"zero_optimization": {**BLOCKS["deepspeed_zero2"]["zero_optimization"], "stage": 1}} if stage == 1 else {})


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def batch(model_path: str) -> DataProto:
    """16 left-padded arithmetic strings of different lengths."""
    tokenizer = load_tokenizer(model_path)
    texts = [f"{a}+{b * 7}={a + b * 7}" for a in range(4) for b in range(4)]
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    return DataProto.from_dict(tensors={"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]})


@pytest.fixture(scope="module")
def eos_list_path(model_path: str, batch: DataProto, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model laid out as Llama-3-Instruct: two EOS ids (the second the token its greedy samples of `batch`
    use most, so some end early) and no pad id."""
    path = tmp_path_factory.mktemp("eos_list")
    shutil.copytree(model_path, path, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    inputs = {k: batch.batch[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=12, do_sample=False)[:, inputs["input_ids"].shape[1] :]
    eos_ids = [model.generation_config.eos_token_id, int(generated.flatten().mode().values)]
    model.config.eos_token_id, model.config.pad_token_id = eos_ids, None
    model.config.save_pretrained(path)
    GenerationConfig(bos_token_id=model.config.bos_token_id, eos_token_id=eos_ids).save_pretrained(path)
    return str(path)


def start_role(
    pool: HostPool,
    manager: ResourceManager,
    model_path: str,
    block: dict,
    *,
    strategy: str = "deepspeed_train",
    dtype: str = "fp32",
    devices: str = "0-1",
    micro: int = 2,
    accumulation: int = 2,
    lora_rank: int = 0,
    gradient_checkpointing: bool = False,
    offload_dir: str = "",
    worker_cls: str = WORKER,
    role: str = "actor",
) -> Cluster:
    """Start `strategy` with `block` on `devices` as `role` in `worker_cls`; with `offload_dir`, phase offloading moves
    its states there."""
    config = WorkerConfig(
        worker_cls=worker_cls,
        device_mapping=devices,
        infer_batch_size=4,
        model_args=ModelArguments(model_name_or_path=model_path, dtype=dtype, lora_rank=lora_rank),
        strategy_args=StrategyArguments(
            strategy_name=strategy,
            strategy_config=block,
            offload_device="nvme" if offload_dir else "cpu",
            offload_dir=offload_dir,
        ),
        training_args=TrainingArguments(
            learning_rate=2e-3,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=accumulation,
            gradient_checkpointing=gradient_checkpointing,
        ),
    )
    config.resolve(role, manager.total_devices)
    cluster = pool.start(worker_cls, config, manager)
    cluster.initialize()
    return cluster


def train_losses(cluster: Cluster, batch: DataProto, steps: int) -> list[float]:
    """Global mean loss of each train call (every rank reports the same value)."""
    losses = []
    for _ in range(steps):
        metrics = cluster.train(batch)
        assert len({round(m["loss"], 12) for m in metrics}) == 1
        losses.append(metrics[0]["loss"])
    return losses


def run_stage(
    pool: HostPool,
    manager: ResourceManager,
    model_path: str,
    batch: DataProto,
    stage: int,
    dtype: str,
    **options: object,
) -> list[float]:
    cluster = start_role(pool, manager, model_path, zero_block(stage), dtype=dtype, **options)
    try:
        return train_losses(cluster, batch, 3)
    finally:
        cluster.shutdown()


def require_cpu_dtype(dtype: str) -> None:
    """Skip unless this CPU computes in `dtype` (DeepSpeed refuses fp16 without AVX512-FP16/AMX-FP16)."""
    reason = get_platform("cpu").dtype_unsupported_reason(dtype)
    if reason:
        pytest.skip(f"this CPU has no {dtype} support ({reason})")


@pytest.fixture(scope="module")
def fp32_losses(
    host_pool: HostPool, resource_manager: ResourceManager, model_path: str, batch: DataProto
) -> list[float]:
    """Three fp32 steps at ZeRO stage 0: the losses every other precision and stage is compared with."""
    return run_stage(host_pool, resource_manager, model_path, batch, 0, "fp32")


def test_same_losses_at_every_zero_stage_in_fp32(
    host_pool: HostPool,
    resource_manager: ResourceManager,
    model_path: str,
    batch: DataProto,
    fp32_losses: list[float],
    zero2_run: CheckpointedRun,
    zero3_run: CheckpointedRun,
) -> None:
    assert fp32_losses[-1] < fp32_losses[0]  # it learns
    # Stages 2 and 3 come from the checkpointed runs, whose third step follows the save (and, at stage 3, the
    # log-probs and the export): none of them may change what the next step computes. The stage-2 run recomputes its
    # activations (gradient checkpointing), which must not change the losses either.
    stage_1 = run_stage(host_pool, resource_manager, model_path, batch, 1, "fp32")
    for stage, losses in ((1, stage_1), (2, zero2_run.losses[:3]), (3, zero3_run.losses[:3])):
        assert losses == pytest.approx(fp32_losses, rel=1e-5), f"stage {stage}: {losses} vs {fp32_losses}"
    # One rank alone skips DeepSpeed's stage-0 gradient all-reduce (a flattened copy of every gradient) and loses
    # nothing.
    alone = run_stage(
        host_pool, resource_manager, model_path, batch[SAME_STEPS_ON_ONE_RANK], 0, "fp32", devices="0", accumulation=4
    )
    assert alone == pytest.approx(fp32_losses, rel=1e-5)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16_bit_training_follows_fp32(
    host_pool: HostPool,
    resource_manager: ResourceManager,
    model_path: str,
    batch: DataProto,
    fp32_losses: list[float],
    dtype: str,
) -> None:
    require_cpu_dtype(dtype)
    for stage in (0, 3) if dtype == "bf16" else (2,):
        losses = run_stage(host_pool, resource_manager, model_path, batch, stage, dtype)
        if dtype == "bf16":
            assert losses == pytest.approx(fp32_losses, rel=3e-2), f"stage {stage}: {losses} vs {fp32_losses}"
        else:
            # Dynamic loss scaling skips the first steps while it lowers the scale from 2**16, then it learns.
            assert losses[0] == losses[1] and losses[2] < losses[1] - 0.2, losses


@pytest.mark.parametrize("block_name", ["deepspeed_zero2_cpuoffload", "deepspeed_zero3_cpuoffload"])
def test_offload_blocks_train(
    host_pool: HostPool, resource_manager: ResourceManager, model_path: str, batch: DataProto, block_name: str
) -> None:
    cluster = start_role(host_pool, resource_manager, model_path, copy.deepcopy(BLOCKS[block_name]))
    try:
        losses = train_losses(cluster, batch, 4)
        # The states live in host memory on a CPU platform: phases do not call an offload that moves nothing.
        assert cluster.offload_moves_states() == [False, False]
    finally:
        cluster.shutdown()
    assert losses[-1] < losses[0] - 0.1, losses


@dataclass(frozen=True)
class CheckpointedRun:
    """Four train calls of one cluster; after the second, a checkpoint (tag step2), the log-probs of the batch and an
    HF export."""

    losses: list[float]
    checkpoint_dir: Path
    log_probs: torch.Tensor
    export_dir: Path


def checkpointed_run(
    pool: HostPool,
    manager: ResourceManager,
    model_path: str,
    batch: DataProto,
    block: dict,
    out: Path,
    **options: object,
) -> CheckpointedRun:
    """Train `block` two calls, save, score and export into `out`, then train two more calls."""
    cluster = start_role(pool, manager, model_path, block, **options)
    try:
        losses = train_losses(cluster, batch, 2)
        assert cluster.save_checkpoint(str(out / "checkpoints"), "step2") == [str(out / "checkpoints" / "step2")] * 2
        log_probs = cluster.log_probs(batch).batch["log_probs"]
        cluster.export_hf(str(out / "hf"))
        losses += train_losses(cluster, batch, 2)
    finally:
        cluster.shutdown()
    return CheckpointedRun(losses, out / "checkpoints", log_probs, out / "hf")


def resumed_losses(
    pool: HostPool,
    manager: ResourceManager,
    model_path: str,
    batch: DataProto,
    block: dict,
    checkpoint_dir: Path,
    **options: object,
) -> list[float]:
    """Two train calls' losses of a new cluster loaded from `checkpoint_dir`'s latest checkpoint."""
    cluster = start_role(pool, manager, model_path, block, **options)
    try:
        cluster.load_checkpoint(str(checkpoint_dir))
        return train_losses(cluster, batch, 2)
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def zero2_run(
    host_pool: HostPool,
    resource_manager: ResourceManager,
    model_path: str,
    batch: DataProto,
    tmp_path_factory: pytest.TempPathFactory,
) -> CheckpointedRun:
    """Stage 2 with gradient checkpointing (one run checks both against the fp32 losses)."""
    out = tmp_path_factory.mktemp("zero2")
    return checkpointed_run(
        host_pool, resource_manager, model_path, batch, zero_block(2), out, gradient_checkpointing=True
    )


@pytest.fixture(scope="module")
def zero3_run(
    host_pool: HostPool,
    resource_manager: ResourceManager,
    model_path: str,
    batch: DataProto,
    tmp_path_factory: pytest.TempPathFactory,
) -> CheckpointedRun:
    return checkpointed_run(
        host_pool, resource_manager, model_path, batch, zero_block(3), tmp_path_factory.mktemp("zero3")
    )


def test_save_then_load_continues_exactly(
    host_pool: HostPool,
    resource_manager: ResourceManager,
    model_path: str,
    batch: DataProto,
    zero2_run: CheckpointedRun,
) -> None:
    resumed = resumed_losses(
        host_pool,
        resource_manager,
        model_path,
        batch,
        zero_block(2),
        zero2_run.checkpoint_dir,
        gradient_checkpointing=True,
    )
    assert resumed == pytest.approx(zero2_run.losses[2:], rel=1e-6)


def test_two_rank_checkpoint_resumes_on_one_rank(
    host_pool: HostPool,
    resource_manager: ResourceManager,
    model_path: str,
    batch: DataProto,
    zero3_run: CheckpointedRun,
) -> None:
    # One rank keeps the global batch (micro 2 x accumulation 4 x 1 rank = 2 x 2 x 2 ranks) and, with
    # rows reordered, each optimizer step sees the rows the two ranks saw together.
    resumed = resumed_losses(
        host_pool,
        resource_manager,
        model_path,
        batch[SAME_STEPS_ON_ONE_RANK],
        zero_block(3),
        zero3_run.checkpoint_dir,
        devices="0",
        accumulation=4,
    )
    assert resumed == pytest.approx(zero3_run.losses[2:], rel=1e-4)


def test_hf_export_loads_with_equal_logits(model_path: str, batch: DataProto, zero3_run: CheckpointedRun) -> None:
    exported = AutoModelForCausalLM.from_pretrained(zero3_run.export_dir, dtype=torch.float32)
    inputs = {k: batch.batch[k] for k in ("input_ids", "attention_mask")}
    position_ids = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = exported(**inputs, position_ids=position_ids).logits
    mask = inputs["attention_mask"][:, 1:].bool()
    exported_log_probs = next_token_log_probs(logits, inputs["input_ids"])
    assert torch.allclose(exported_log_probs[mask], zero3_run.log_probs[mask], atol=1e-5)
    original = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    assert not torch.equal(original.lm_head.weight, exported.lm_head.weight)  # the trained weights were exported


def test_lora_trains_adapters_and_exports_a_merged_plain_model(
    host_pool: HostPool, resource_manager: ResourceManager, model_path: str, batch: DataProto, tmp_path: Path
) -> None:
    cluster = start_role(host_pool, resource_manager, model_path, zero_block(3), lora_rank=8)
    try:
        losses = train_losses(cluster, batch, 3)
        strategy_log_probs = cluster.log_probs(batch).batch["log_probs"]
        cluster.export_hf(str(tmp_path / "hf"))
    finally:
        cluster.shutdown()
    assert losses[-1] < losses[0], losses
    assert not list((tmp_path / "hf").glob("adapter_*"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    exported_state, original_state = exported.state_dict(), original.state_dict()
    assert exported_state.keys() == original_state.keys()
    changed = {k for k in original_state if not torch.equal(original_state[k], exported_state[k])}
    assert changed and all(
        k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")) for k in changed
    )
    inputs = {k: batch.batch[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        logits = exported(**inputs, position_ids=(inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)).logits
    mask = inputs["attention_mask"][:, 1:].bool()
    assert torch.allclose(next_token_log_probs(logits, inputs["input_ids"])[mask], strategy_log_probs[mask], atol=1e-4)


def test_zero3_inference_generation_with_uneven_lengths_finishes(
    host_pool: HostPool, resource_manager: ResourceManager, eos_list_path: str, batch: DataProto
) -> None:
    """ZeRO-3 generation on a model with a list of EOS ids and no pad: ranks stay in step, and the greedy samples,
    their lengths and stop reasons are hf_infer's."""
    cluster = start_role(host_pool, resource_manager, eos_list_path, zero_block(3), strategy="deepspeed_infer")
    greedy_args = GeneratingArguments(max_new_tokens=12, do_sample=False)
    try:
        args = GeneratingArguments(max_new_tokens=12, do_sample=True, temperature=1.5, seed=3)
        prompts = batch.select(batch_keys=["input_ids", "attention_mask"])
        # Rank 1 gets prompts whose samples stop at different steps from rank 0's; synced ranks must not hang.
        future = cluster.generate(prompts, args, blocking=False)
        output = future.get(timeout=300).batch["output_ids"]
        greedy = cluster.generate(prompts, greedy_args)
        log_probs = cluster.log_probs(batch).batch["log_probs"]
    finally:
        cluster.shutdown()
    assert output.shape == (16, batch.batch["input_ids"].shape[1] + 12)
    assert torch.equal(output[:, : batch.batch["input_ids"].shape[1]], batch.batch["input_ids"])
    assert log_probs.shape == (16, batch.batch["input_ids"].shape[1] - 1) and torch.isfinite(log_probs).all()
    model = AutoModelForCausalLM.from_pretrained(eos_list_path, dtype=torch.float32)
    expected = generate_in_micro_batches(model, prompts, greedy_args, 4, "cpu")  # hf_infer's, 4 rows at a time
    assert torch.equal(greedy.batch["output_ids"], expected.output_ids)
    assert torch.equal(greedy.batch["response_lengths"], expected.response_lengths)
    assert torch.equal(greedy.batch["truncated"], expected.truncated)
    assert expected.truncated.any() and not expected.truncated.all()


def test_hf_infer_matches_the_plain_model(
    host_pool: HostPool, resource_manager: ResourceManager, model_path: str, batch: DataProto
) -> None:
    cluster = start_role(host_pool, resource_manager, model_path, {}, strategy="hf_infer")
    try:
        log_probs = cluster.log_probs(batch).batch["log_probs"]
        greedy = cluster.generate(batch, GeneratingArguments(max_new_tokens=6, do_sample=False)).batch["output_ids"]
    finally:
        cluster.shutdown()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    inputs = {k: batch.batch[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        logits = model(**inputs, position_ids=(inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)).logits
        expected = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0)
    mask = inputs["attention_mask"][:, 1:].bool()
    assert torch.allclose(next_token_log_probs(logits, inputs["input_ids"])[mask], log_probs[mask], atol=1e-5)
    assert torch.equal(greedy[:, : expected.shape[1]], expected)


def infinity_block(device: str, nvme_dir: Path) -> dict:
    """ZeRO-3 with parameters and optimizer states offloaded to `device` ("cpu", or "nvme": ZeRO-Infinity, into
    `nvme_dir`); every parameter partitioned (the tiny model's are all below the default persistence threshold)."""
    block = copy.deepcopy(BLOCKS["deepspeed_zero3_cpuoffload"])
    zero = block["zero_optimization"]
    zero["stage3_param_persistence_threshold"] = 0
    if device == "nvme":
        # Swap buffers sized for a tiny model: DeepSpeed's default (5 x 1e8 elements, page-locked) is 2 GB a rank.
        zero["offload_param"] = {"device": "nvme", "nvme_path": str(nvme_dir), "buffer_count": 5, "buffer_size": 1e6}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(nvme_dir), "buffer_count": 4}
    return block


def test_zero_infinity_nvme_offload_follows_cpu_offload(
    host_pool: HostPool, resource_manager: ResourceManager, batch: DataProto, tmp_path: Path
) -> None:
    """ZeRO-3 with parameters and Adam states swapped to disk (DeepSpeed's async I/O op over libaio) trains the same
    losses as with them in host memory, and the swap files hold them while the engine lives."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible():
        pytest.skip("DeepSpeed's async_io op cannot build: libaio-dev is missing (scripts/setup_env.sh installs it)")
    # DeepSpeed swaps only partitions of 1 MiB or more: MLP matrices of 256 x 4096 fp32, halved over 2 ranks.
    model_path = str(make_tiny_model(tmp_path / "model", TinyModelSpec(hidden_size=256, intermediate_size=4096)))
    swap_dir = tmp_path / "nvme"
    losses, swapped_bytes = {}, 0
    for device in ("cpu", "nvme"):
        cluster = start_role(host_pool, resource_manager, model_path, infinity_block(device, swap_dir))
        try:
            losses[device] = train_losses(cluster, batch, 3)
            swapped_bytes = sum(f.stat().st_size for f in swap_dir.rglob("*") if f.is_file())
        finally:
            cluster.shutdown()
    assert losses["nvme"] == pytest.approx(losses["cpu"], rel=1e-5), losses
    assert losses["nvme"][-1] < losses["nvme"][0]
    # The swapped partitions (fp32 parameters, Adam's moments, the master copy) of 3 x 1M MLP weights: megabytes.
    assert swapped_bytes > 8_000_000, swapped_bytes
