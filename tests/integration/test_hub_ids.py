"""`roll-rm pretrain=org/tiny` trains offline from a pre-filled Hugging Face cache: the driver fetches the id into
its snapshot directory when the config validates, and the workers load that directory (they have no hub to ask)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from roll.models.tiny import make_tiny_model
from tests.unit.test_hub_ids import MAIN, snapshot_dir

pytestmark = pytest.mark.slow

# One step of 8 pairs on one rank at ZeRO stage 0, 16 held-out pairs: the least that trains and exports.
ONE_STEP = [
    "platform=cpu",
    "devices_per_node=1",
    "reward_model.device_mapping=0",
    "reward_model.strategy_args.strategy_config=${deepspeed_zero}",
    "batch_size=8",
    "eval_batch_size=16",
    "max_steps=1",
    "eval_steps=1",
    "save_steps=0",
    "reward_model.training_args.per_device_train_batch_size=16",  # 8 pairs = 16 rows
    "reward_model.training_args.warmup_steps=0",
]
EMBEDDING = "model.embed_tokens.weight"


def test_a_run_trains_from_a_hub_id_in_the_offline_cache(tmp_path: Path) -> None:
    hf_home = tmp_path / "hf_home"
    # Another seed than tiny://qwen2's, so that the weights tell which model the workers loaded.
    snapshot = make_tiny_model(snapshot_dir(hf_home / "hub", "model", "org/tiny", MAIN), seed=7)
    env = os.environ | {
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    command = ["roll-rm", "pretrain=org/tiny", *ONE_STEP, f"output_dir={tmp_path / 'out'}"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    trained = load_file(tmp_path / "out" / "rm" / "model" / "model.safetensors")[EMBEDDING]
    start = load_file(snapshot / "model.safetensors")[EMBEDDING]
    # One Adam step at lr 3e-4 moves a weight by about 3e-4; another initialisation differs by about 0.03.
    assert 0 < (trained - start).abs().max().item() < 1e-2
