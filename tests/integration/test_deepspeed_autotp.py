"""deepspeed_train with DeepSpeed AutoTP (tensor_parallel.autotp_size=2) on 2 CPU ranks over gloo: tp=2, dp=1."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from roll.distributed.executor.cluster import Cluster
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.scheduler.resource_manager import ResourceManager
from tests.integration import test_deepspeed_strategy as deepspeed_roles
from tests.integration.test_deepspeed_strategy import resume_losses, start_role, train_losses, zero_block
from tests.strategy_workers import next_token_log_probs

pytestmark = pytest.mark.slow
# The tiny model, its 16-row batch and the 2-device reservation of the plain DeepSpeed strategy tests.
model_path = deepspeed_roles.model_path
batch = deepspeed_roles.batch
resource_manager = deepspeed_roles.resource_manager


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
    resource_manager: ResourceManager, model_path: str, batch: DataProto, tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[float], Path]:
    """One rank without tensor parallelism, same micro-batches and steps: losses and its export."""
    export_dir = tmp_path_factory.mktemp("tp1") / "hf"
    cluster = start_role(resource_manager, model_path, zero_block(1), devices="0")
    losses, _ = train_and_export(cluster, batch, export_dir)
    return losses, export_dir


@pytest.mark.parametrize("stage", [1, 3])
def test_tp2_trains_like_one_rank_and_exports_full_weights(
    resource_manager: ResourceManager,
    model_path: str,
    batch: DataProto,
    unsharded: tuple[list[float], Path],
    tmp_path: Path,
    stage: int,
) -> None:
    cluster = start_role(resource_manager, model_path, autotp_block(stage))
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
    resource_manager: ResourceManager, model_path: str, batch: DataProto, tmp_path: Path
) -> None:
    uninterrupted, resumed = resume_losses(resource_manager, model_path, batch, autotp_block(1), tmp_path)
    assert resumed == pytest.approx(uninterrupted, rel=1e-6)
    model_states = sorted(p.name for p in (tmp_path / "step2" / "state").glob("mp_rank_*"))
    assert model_states == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]  # one per tensor-parallel rank
