"""The 0.5B-class CPU recipe (rlvr_qwen2.5_0.5b_cpu.yaml) end to end, as its README command starts it.

Its layout (one rank per role on both cores, ZeRO-0, no offload copies on CPU) runs here on a model with
Qwen2.5-0.5B's 151,936-row tied vocabulary and fewer, narrower layers, to keep the suite short; the full
shape's run, its memory and its step time are benchmarks/scale_memory.py's (docs/memory_estimate.md).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.pipeline_runs import logged_metrics

pytestmark = pytest.mark.slow
NARROW_WIDE_VOCAB = (
    "tiny://qwen2?hidden_size=128&num_layers=2&num_heads=4&num_kv_heads=2&intermediate_size=256"
    "&tie_word_embeddings=true&vocab_size=151936"
)


def test_the_cpu_recipe_trains_evaluates_and_moves_no_state_copies(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "examples/start_rlvr_pipeline.py",
        "--config-name=rlvr_qwen2.5_0.5b_cpu",
        f"pretrain='{NARROW_WIDE_VOCAB}'",
        "max_steps=2",
        "eval_steps=2",
        f"output_dir={tmp_path}",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = logged_metrics(tmp_path / "rlvr_qwen2.5_0.5b_cpu")
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert all(0 <= rows[step]["val/accuracy"] <= 1 for step in (0, 2))
    # Updates ran (a random model answers no sum right, so its groups' rewards tie and carry no gradient here).
    assert all(math.isfinite(row["actor/loss"]) and "actor/grad_norm" in row for row in rows[1:])
    # Every role shares both cores, yet on CPU nothing is copied between phases: host memory is the device.
    assert all(row["phase/actor_update/bytes_moved"] == 0 for row in rows[1:])
