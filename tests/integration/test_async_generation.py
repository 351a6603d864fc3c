"""Generation overlapped with training on the real stack: actor_infer on a device of its own, k = 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_rlvr_pipeline import make_config, run

pytestmark = pytest.mark.slow


def test_k1_trains_on_batches_at_most_one_version_old(ray_session: None, tmp_path: Path) -> None:
    config = make_config(
        tmp_path,
        "max_steps=3",
        "eval_steps=3",
        "eval_batch_size=8",
        "async_generation_ratio=1",
        "algorithm.tis_cap=2.0",
        "actor_train.device_mapping=0",
        "reference.device_mapping=0",
        "actor_infer.device_mapping=1",
    )
    rows = run(config)
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    steps = rows[1:]
    # Step 1's batch came from the initial weights; every later one was generated during the previous update.
    assert [row["rollout/staleness_max"] for row in steps] == [0.0, 1.0, 1.0]
    assert all(row["rollout/staleness_max"] <= config.async_generation_ratio for row in steps)
    assert [row["rollout/staleness_mean"] for row in steps] == [0.0, 1.0, 1.0]
    # actor_infer is on its own device: the weights travel by broadcast, after each update.
    assert all(row["sync/broadcast_bytes"] > 0 for row in steps[1:])
    for row in steps:
        assert 0 < row["actor/tis_weight_mean"] <= row["actor/tis_weight_max"] <= 2.0
        assert 0 <= row["actor/tis_clipped_fraction"] <= 1
    assert rows[-1]["val/accuracy"] >= 0
