"""vLLM on a device of its own, generating while actor_train trains (k = 1), on the real stack.

One run feeds both tests: actor_infer swapped to vLLM by override on device slot 1, actor_train (ZeRO-2 with
CPU offload) and the reference on slot 0, so every weight sync goes over the broadcast group.
"""

from __future__ import annotations

import pytest

from roll.pipeline.rlvr.rlvr_config import RLVRConfig
from tests.rlvr_runs import ONE_RANK, PARITY_REWARD, arithmetic_config, assert_zero_stage, block, run_rlvr

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def overlapped(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[RLVRConfig, list[dict]]:
    """Three overlapped steps on vLLM, evaluated before and after: the config and its metrics rows."""
    config = arithmetic_config(
        tmp_path_factory.mktemp("overlapped"),
        *ONE_RANK,
        "max_steps=3",
        "eval_steps=3",
        "eval_batch_size=8",
        "devices_per_node=2",
        "actor_infer.device_mapping=1",
        "actor_infer.strategy_args.strategy_name=vllm",
        "async_generation_ratio=1",
        "algorithm.tis_cap=2.0",
        PARITY_REWARD,
        block("deepspeed_zero2_cpuoffload"),
    )
    return config, run_rlvr(config)


def test_k1_trains_on_batches_at_most_one_version_old(overlapped: tuple[RLVRConfig, list[dict]]) -> None:
    config, rows = overlapped
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    steps = rows[1:]
    # Step 1's batch came from the initial weights; every later one was generated during the previous update.
    assert [row["rollout/staleness_max"] for row in steps] == [0.0, 1.0, 1.0]
    assert all(row["rollout/staleness_max"] <= config.async_generation_ratio for row in steps)
    assert [row["rollout/staleness_mean"] for row in steps] == [0.0, 1.0, 1.0]
    for row in steps:
        assert 0 < row["actor/tis_weight_mean"] <= row["actor/tis_weight_max"] <= 2.0
        assert 0 <= row["actor/tis_clipped_fraction"] <= 1
    assert rows[-1]["val/accuracy"] >= 0


def test_vllm_on_a_device_of_its_own_follows_the_trainer_over_the_broadcast_group(
    overlapped: tuple[RLVRConfig, list[dict]],
) -> None:
    config, rows = overlapped
    assert_zero_stage(config, 2)
    # After each update the weights travel by broadcast (the gloo group), none by the colocated route.
    for row in rows[2:]:
        assert row["sync/broadcast_bytes"] > 0 and row["sync/colocated_bytes"] == 0
    assert rows[1]["actor/grad_norm"] > 0  # the synced weights changed
    assert rows[1]["rollout/response_length_mean"] > 0
