"""deepspeed_train with DeepSpeed AutoTP (tensor_parallel.autotp_size=2) over gloo: tp=2, dp=1 on 2 CPU ranks, and
dp=2 x tp=2 on four device slots (losses, a weight sync into hf_infer, a phase offload to disk).

The tiny qwen2 has separate q/k/v projections; a tiny Falcon adds a fused query_key_value projection with a bias,
which AutoTP cuts as a fused-QKV layer by default or as a sub-parameter layer under a `partition_config`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, FalconConfig, FalconForCausalLM

from roll.distributed.executor.cluster import Cluster
from roll.distributed.executor.weight_syncer import WeightSyncer
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.scheduler.resource_manager import ResourceManager
from roll.distributed.weight_sync.plan import devices_per_worker, plan_weight_sync
from roll.models.tiny import build_char_tokenizer
from roll.platforms import get_platform
from tests.integration import test_deepspeed_strategy as deepspeed_roles
from tests.integration.test_deepspeed_strategy import (
    checkpointed_run,
    resumed_losses,
    start_role,
    train_losses,
    zero_block,
)
from tests.strategy_workers import next_token_log_probs
from tests.worker_pool import HostPool

pytestmark = pytest.mark.slow
# The tiny model and its 16-row batch of the plain DeepSpeed strategy tests (the 2-slot reservation is conftest.py's).
model_path = deepspeed_roles.model_path
batch = deepspeed_roles.batch


def autotp_block(stage: int, tp_size: int = 2) -> dict:
    """The examples/config block of ZeRO `stage` with AutoTP over `tp_size` ranks."""
    return copy.deepcopy(zero_block(stage)) | {"tensor_parallel": {"autotp_size": tp_size}}


def exported_log_probs(path: Path, batch: DataProto) -> torch.Tensor:
    """Next-token log-probs of `batch` from the Hugging Face directory at `path`, loaded in fp32."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    inputs = {k: batch.batch[k] for k in ("input_ids", "attention_mask")}
    position_ids = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(**inputs, position_ids=position_ids).logits
    return next_token_log_probs(logits, inputs["input_ids"])


def train_and_export(cluster: Cluster, batch: DataProto, export_dir: Path) -> tuple[list[float], torch.Tensor]:
    """Two train calls (4 optimizer steps each), then the role's own log-probs and an HF export to `export_dir`."""
    try:
        losses = train_losses(cluster, batch, 2)
        log_probs = cluster.log_probs(batch).batch["log_probs"]
        cluster.export_hf(str(export_dir))
    finally:
        cluster.shutdown()
    return losses, log_probs


@pytest.fixture(scope="module")
def unsharded(
    host_pool: HostPool,
    resource_manager: ResourceManager,
    model_path: str,
    batch: DataProto,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[list[float], Path]:
    """One rank without tensor parallelism, same micro-batches and steps: losses and its export."""
    export_dir = tmp_path_factory.mktemp("tp1") / "hf"
    cluster = start_role(host_pool, resource_manager, model_path, zero_block(1), devices="0")
    losses, _ = train_and_export(cluster, batch, export_dir)
    return losses, export_dir


@pytest.mark.parametrize("stage", [1, 3])
def test_tp2_trains_like_one_rank_and_exports_full_weights(
    host_pool: HostPool,
    resource_manager: ResourceManager,
    model_path: str,
    batch: DataProto,
    unsharded: tuple[list[float], Path],
    tmp_path: Path,
    stage: int,
) -> None:
    cluster = start_role(host_pool, resource_manager, model_path, autotp_block(stage))
    layout = [(r.dp_rank, r.dp_size, r.tp_rank, r.tp_size) for r in cluster.rank_infos]
    assert layout == [(0, 1, 0, 2), (0, 1, 1, 2)]  # one data-parallel group of two tensor-parallel ranks
    losses, log_probs = train_and_export(cluster, batch, tmp_path / "hf")
    unsharded_losses, unsharded_export = unsharded
    assert losses[-1] < losses[0]
    assert losses == pytest.approx(unsharded_losses, rel=1e-5)
    mask = batch.batch["attention_mask"][:, 1:].bool()
    exported = exported_log_probs(tmp_path / "hf", batch)
    assert torch.allclose(exported[mask], log_probs[mask], atol=1e-5)  # the export is the model that trained
    assert torch.allclose(exported[mask], exported_log_probs(unsharded_export, batch)[mask], atol=1e-5)
    shard_width = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").model.layers[0].mlp.up_proj.weight.shape[0]
    assert shard_width == 256  # whole, not one rank's 128 rows


def test_tp2_checkpoint_resumes_with_the_same_losses(
    host_pool: HostPool, resource_manager: ResourceManager, model_path: str, batch: DataProto, tmp_path: Path
) -> None:
    run = checkpointed_run(host_pool, resource_manager, model_path, batch, autotp_block(1), tmp_path)
    resumed = resumed_losses(host_pool, resource_manager, model_path, batch, autotp_block(1), run.checkpoint_dir)
    assert resumed == pytest.approx(run.losses[2:], rel=1e-6)
    model_states = sorted(p.name for p in (run.checkpoint_dir / "step2" / "state").glob("mp_rank_*"))
    assert model_states == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]  # one per tensor-parallel rank


# Falcon's fused projection holds each head's q, k and v rows together, so two sub-parameters of two heads each,
# cut in half, still give each rank whole heads; the attention output is cut the same way along its input.
SUB_PARAMETER_LAYERS = {
    "use_default_specs": False,
    "layer_specs": [
        {
            "patterns": [r".*\.query_key_value\.weight$"],
            "partition_type": "column",
            "shape": [2, -1],
            "partition_dim": 0,
        },
        {
            "patterns": [r".*\.self_attention\.dense\.weight$"],
            "partition_type": "row",
            "shape": [-1, 2],
            "partition_dim": 1,
        },
        {"patterns": [r".*\.dense_h_to_4h\.weight$"], "partition_type": "column"},
        {"patterns": [r".*\.dense_4h_to_h\.weight$"], "partition_type": "row"},
    ],
}


@pytest.fixture(scope="module")
def fused_qkv_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Falcon with biases (fused query_key_value, 4 heads of 16) and the char tokenizer."""
    path = tmp_path_factory.mktemp("falcon")
    tokenizer = build_char_tokenizer()
    config = FalconConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        bias=True,
        new_decoder_architecture=False,
        multi_query=False,
        parallel_attn=True,
        alibi=False,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        FalconForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def train_export_and_sync(cluster: Cluster, batch: DataProto, export_dir: Path) -> list[dict[str, torch.Tensor]]:
    """One train call (4 optimizer steps), an HF export to `export_dir`, then what each rank's weight sync sends."""
    try:
        train_losses(cluster, batch, 1)
        cluster.export_hf(str(export_dir))
        return cluster.hf_weights()
    finally:
        cluster.shutdown()


def state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


@pytest.fixture(scope="module")
def fused_qkv_unsharded(
    host_pool: HostPool,
    resource_manager: ResourceManager,
    fused_qkv_path: str,
    batch: DataProto,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, torch.Tensor]:
    """The Falcon's weights after the same steps on one rank without tensor parallelism."""
    export_dir = tmp_path_factory.mktemp("falcon_tp1") / "hf"
    train_export_and_sync(
        start_role(host_pool, resource_manager, fused_qkv_path, zero_block(1), devices="0"), batch, export_dir
    )
    return state_dict(export_dir)


@pytest.mark.parametrize(("layers", "stage"), [("fused-qkv", 1), ("sub-parameter", 3)])
def test_tp2_exports_and_syncs_the_full_weights_of_fused_qkv_layers_with_a_bias(
    host_pool: HostPool,
    resource_manager: ResourceManager,
    fused_qkv_path: str,
    batch: DataProto,
    fused_qkv_unsharded: dict[str, torch.Tensor],
    tmp_path: Path,
    layers: str,
    stage: int,
) -> None:
    block = autotp_block(stage)
    if layers == "sub-parameter":
        block["tensor_parallel"]["partition_config"] = copy.deepcopy(SUB_PARAMETER_LAYERS)
    synced = train_export_and_sync(
        start_role(host_pool, resource_manager, fused_qkv_path, block), batch, tmp_path / "hf"
    )
    exported, initial = state_dict(tmp_path / "hf"), state_dict(fused_qkv_path)
    bias = "transformer.h.0.self_attention.query_key_value.bias"
    assert not torch.allclose(fused_qkv_unsharded[bias], initial[bias], atol=1e-4)  # the steps moved it
    assert exported.keys() == fused_qkv_unsharded.keys()
    for name, tensor in fused_qkv_unsharded.items():
        # Adam's steps can widen a rounding difference to ~1e-5; a row out of place would be off by ~1e-2.
        assert torch.allclose(exported[name], tensor, atol=1e-4), name  # the unsharded run's weights
    assert len(synced) == 2
    for weights in synced:  # every rank sends the full tensors
        assert {name: t.shape for name, t in weights.items()} == {name: t.shape for name, t in exported.items()}
        assert all(torch.allclose(tensor, exported[name], atol=1e-6) for name, tensor in weights.items())


# dp = 2 x tp = 2: four device slots on the 2-core machine (1 torch thread per rank), one reservation for every check.
DP2_TP2_LAYOUT = [(0, 2, 0, 2), (0, 2, 1, 2), (1, 2, 0, 2), (1, 2, 1, 2)]


@pytest.fixture(scope="module")
def four_slots(ray_session: None) -> Iterator[ResourceManager]:
    manager = ResourceManager(get_platform("cpu"), num_nodes=1, devices_per_node=4, cpus_per_device=1)
    yield manager
    manager.destroy()


def sync_to_engine(trainer: Cluster, engine: Cluster) -> dict[str, float]:
    """One weight sync along the colocated routes: each engine worker takes the trainer rank on its device slot."""
    plan = plan_weight_sync(
        devices_per_worker(trainer.worker_config.devices, 1),
        devices_per_worker(engine.worker_config.devices, 1),
        engine.weight_sync_shards(),
    )
    return WeightSyncer(trainer, engine, plan, bucket_bytes=2**16).sync()


def test_dp2_tp2_trains_like_plain_data_parallel_syncs_an_engine_and_survives_offload(
    host_pool: HostPool, four_slots: ResourceManager, model_path: str, batch: DataProto, tmp_path: Path
) -> None:
    plain = start_role(
        host_pool, four_slots, model_path, zero_block(3), devices="0-1"
    )  # dp = 2, tp = 1: the same 8 rows a step
    try:
        expected = train_losses(plain, batch, 2)
    finally:
        plain.shutdown()
    trainer = start_role(
        host_pool, four_slots, model_path, autotp_block(3), devices="0-3", offload_dir=str(tmp_path / "off")
    )
    engine = start_role(host_pool, four_slots, model_path, {}, strategy="hf_infer", devices="1-2")
    try:
        assert [(r.dp_rank, r.dp_size, r.tp_rank, r.tp_size) for r in trainer.rank_infos] == DP2_TP2_LAYOUT
        # DeepSpeed's own groups agree with roll's layout: tensor-parallel peers consecutive, data-parallel strided.
        groups = trainer.deepspeed_groups()
        assert [g["tp"] for g in groups] == [[0, 1], [0, 1], [2, 3], [2, 3]]
        assert [g["dp"] for g in groups] == [[0, 2], [1, 3], [0, 2], [1, 3]]
        losses = train_losses(trainer, batch, 1)

        # Engine workers on slots 1 and 2 take tp rank 1 of group 0 and tp rank 0 of group 1: both send full weights.
        metrics = sync_to_engine(trainer, engine)
        gathered = trainer.hf_weights()
        assert metrics["sync/colocated_bytes"] == 2 * sum(t.nbytes for t in gathered[0].values())
        for received in engine.hf_weights():
            assert received.keys() == gathered[0].keys()
            assert all(torch.equal(received[name], tensor) for name, tensor in gathered[0].items())
        mask = batch.batch["attention_mask"][:, 1:].bool()
        engine_log_probs = engine.log_probs(batch).batch["log_probs"]
        assert torch.allclose(engine_log_probs[mask], trainer.log_probs(batch).batch["log_probs"][mask], atol=1e-5)

        # A phase offload to disk and back leaves every weight bit for bit, and training goes on as without it.
        moved = trainer.offload_states()
        assert all(m["offload_states/offload/moved_bytes/model_params"] > 0 for m in moved)
        trainer.load_states()
        reloaded = trainer.hf_weights()
        assert all(torch.equal(reloaded[0][name], tensor) for name, tensor in gathered[0].items())
        losses += train_losses(trainer, batch, 1)
    finally:
        trainer.shutdown()
        engine.shutdown()
    assert losses[-1] < losses[0]
    assert losses == pytest.approx(expected, rel=1e-5)
