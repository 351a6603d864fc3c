"""Runs on a real multi-node Ray cluster on this machine: raylets of their own, one per node, on loopback IPs.

The module's cluster (`ray.cluster_utils.Cluster`) has a head at 127.0.0.4 without CPUs, where
drivers connect, and two nodes of 2 CPUs at 127.0.0.2 and 127.0.0.3, so every rank runs on a node
other than its driver's. Each scenario's driver is a subprocess with RAY_ADDRESS set to the cluster:
either an entry point (`examples/start_*.py`) or this file run as a script
(`python -m tests.integration.test_multinode <scenario> ...`, which prints what the test asserts
on as JSON), so the session's embedded Ray (tests/conftest.py) and this cluster never share a process.
A driver that only holds a node's CPUs is tests/placement_holder.py, which imports nothing but Ray.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest

from tests.conftest import CONFIG_DIR, REPO_ROOT
from tests.pipeline_runs import logged_metrics

pytestmark = pytest.mark.slow

HEAD_IP = "127.0.0.4"  # not 127.0.0.1, which Ray's drivers rewrite to the machine's outward address
NODE_IPS = ("127.0.0.2", "127.0.0.3")
NODE_CPUS = 2
RESULT = "scenario result: "  # Ray forwards workers' output to the driver's too: the result line is marked


def rlvr_across_nodes() -> list[str]:
    """A short RLVR run across both nodes: actor_train and reference colocated on device 0 (node 0), actor_infer
    alone on device 1 (node 1), so every weight sync crosses nodes over the broadcast group. The tiny model scores
    0 on arithmetic; a parity reward gives its samples different scores, hence gradients."""
    # Imported here, not with the module: tests.rlvr_runs loads the RLVR pipeline (seconds of CPU), which the
    # ranks scenario's driver, importing this module, does not need.
    from tests.rlvr_runs import FAST, ONE_RANK, PARITY_REWARD

    return [
        *FAST,
        *ONE_RANK,
        "num_nodes=2",
        "actor_infer.device_mapping=1",
        PARITY_REWARD,
        "eval_batch_size=8",
        "eval_steps=100",
    ]


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """The address of a 2-node Ray cluster (plus a CPU-less head) that lives as long as this module's tests."""
    from ray.cluster_utils import Cluster

    temp_dir = tempfile.mkdtemp(prefix="roll_mn_", dir="/tmp")  # this cluster's sessions and logs only
    head = {"num_cpus": 0, "node_ip_address": HEAD_IP, "temp_dir": temp_dir}
    # Ray would record the head in /tmp/ray/ray_current_cluster, where an address-less `ray.init()` of anyone
    # else on this machine would find it and join this cluster instead of theirs.
    try:
        with mock.patch("ray._private.utils.write_ray_address"):
            cluster = Cluster(initialize_head=True, connect=False, head_node_args=head)
        try:
            for ip, name in zip(NODE_IPS, ("node_a", "node_b"), strict=True):
                cluster.add_node(num_cpus=NODE_CPUS, resources={name: 1.0}, node_ip_address=ip)
            cluster.wait_for_nodes()
            yield cluster.address
        finally:
            cluster.shutdown()
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def driver(address: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run `args` (a script and its arguments) as a driver of the cluster at `address`."""
    env = {**os.environ, "RAY_ADDRESS": address, "RAY_DEDUP_LOGS": "0"}
    return subprocess.run(
        [sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def scenario(address: str, name: str) -> dict:
    """Run a scenario of this file as a driver; return the JSON it prints after RESULT."""
    result = driver(address, "-m", "tests.integration.test_multinode", name)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith(RESULT)]
    assert len(lines) == 1, result.stdout[-3000:]
    return json.loads(lines[0].removeprefix(RESULT))


def test_ranks_span_nodes_in_node_order(ray_address: str) -> None:
    ranks = scenario(ray_address, "ranks")
    train, infer = ranks["actor_train"], ranks["actor_infer"]
    # Ranks 0-1 on one node and 2-3 on the other, LOCAL_RANK counting within each node.
    assert train[0]["ip"] == train[1]["ip"] != train[2]["ip"] == train[3]["ip"]
    assert {train[0]["ip"], train[2]["ip"]} == set(NODE_IPS)
    assert [r["LOCAL_RANK"] for r in train] == ["0", "1", "0", "1"]
    # Every rank meets at rank 0's node, not at the driver's (the head).
    assert {r["MASTER_ADDR"] for r in train} == {train[0]["ip"]} and train[0]["ip"] != HEAD_IP
    assert len({r["MASTER_PORT"] for r in train}) == 1
    # actor_infer sits on devices 2-3 only: the second node, beside actor_train's ranks 2 and 3.
    assert [r["ip"] for r in infer] == [train[2]["ip"]] * 2
    assert [r["LOCAL_RANK"] for r in infer] == ["0", "1"] and {r["MASTER_ADDR"] for r in infer} == {train[2]["ip"]}
    # The cluster check's gloo all-reduce over all four ranks (across the nodes) gave the right sum.
    assert ranks["report"]["actor_train"]["backend"] == "gloo"
    assert ranks["report"]["actor_train"]["dp_ranks_in_order"] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_rlvr_syncs_weights_across_nodes(ray_address: str, tmp_path: Path) -> None:
    # A restart reads the checkpoint the same way whatever the placement: test_rlvr_pipeline.py and
    # test_worker_death.py resume runs.
    run = driver(
        ray_address, "examples/start_rlvr_pipeline.py", *rlvr_across_nodes(), f"output_dir={tmp_path}", "max_steps=2"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = logged_metrics(tmp_path / "rlvr")
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert rows[1]["actor/grad_norm"] > 0  # the weights change, so the sync has something to carry
    # actor_infer shares no device with actor_train: every weight travelled over the broadcast group.
    assert rows[2]["sync/broadcast_bytes"] > 0 and rows[2]["sync/colocated_bytes"] == 0
    assert (tmp_path / "rlvr" / "checkpoints" / "step_2" / "driver_state.json").is_file()


def test_a_cluster_too_small_fails_at_once_naming_roles_nodes_and_fix(ray_address: str, tmp_path: Path) -> None:
    # cpus_per_device=2 makes each node's 2 CPUs device slots, as 1-CPU nodes with 1-CPU slots would:
    # the reward worker needs a CPU beyond them.
    started = time.monotonic()
    result = driver(
        ray_address,
        "examples/start_rlvr_pipeline.py",
        *rlvr_across_nodes(),
        "cpus_per_device=2",
        f"output_dir={tmp_path}",
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("placement error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    for part in (
        "device slots need 2 CPU on each of 2 nodes",
        "rewards.math needs 1 worker x 1 CPU",
        f"{NODE_IPS[0]} (node ",
        f"{NODE_IPS[1]} (node ",
        f"{HEAD_IP} (node ",
        "Fix: lower cpus_per_device or add nodes or CPUs",
    ):
        assert part in errors[0], part
    assert "Traceback" not in result.stderr
    assert elapsed < 60, elapsed  # Python, Hydra and the tiny model's build included; no waiting on Ray


def test_a_reservation_held_elsewhere_ends_after_placement_timeout_then_fits(ray_address: str) -> None:
    # README's cluster check command, with a short timeout while another driver holds node_a's CPUs.
    check = [
        "examples/start_cluster_check.py",
        "num_nodes=2",
        "devices_per_node=1",
        "actor_train.device_mapping=0-1",
        "actor_infer.device_mapping=1",
        "platform=cpu",
    ]
    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.placement_holder", "node_a", str(NODE_CPUS)],
        cwd=REPO_ROOT,
        env={**os.environ, "RAY_ADDRESS": ray_address},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        started = time.monotonic()
        held = driver(ray_address, *check, "placement_timeout_s=3")
        elapsed = time.monotonic() - started
    finally:
        holder.kill()
        holder.wait()
    assert held.returncode == 2, held.stderr[-3000:]
    errors = [line for line in held.stderr.splitlines() if line.startswith("placement error:")]
    assert len(errors) == 1 and "did not grant this run's reservation within placement_timeout_s=3" in errors[0]
    assert "free now: 2 CPU" in errors[0] and "raise placement_timeout_s" in errors[0]
    assert elapsed < 45, elapsed
    # Once the holder is gone, the same check gets its reservation and passes across both nodes.
    passed = driver(ray_address, *check)
    assert passed.returncode == 0, passed.stderr[-3000:]
    assert "cluster check passed: 2 role(s) on 2 device(s)" in passed.stdout


# ---- scenarios: the drivers that run in a subprocess ------------------------------------------------------


def ranks_scenario() -> dict:
    """The cluster check with actor_train on all 4 devices of 2 nodes and actor_infer on node 1's; every rank's env."""
    import ray
    from hydra import compose, initialize_config_dir

    from roll.configs.hydra_defaults import register_schema_defaults
    from roll.configs.loader import load_pipeline_config, yaml_names
    from roll.pipeline.cluster_check.cluster_check_config import ClusterCheckConfig
    from roll.pipeline.cluster_check.cluster_check_pipeline import ClusterCheckPipeline

    overrides = [
        "platform=cpu",
        "num_nodes=2",
        "devices_per_node=2",
        "actor_train.device_mapping=0-3",
        "actor_infer.device_mapping=[2,3]",
        "rounds=1",
    ]
    register_schema_defaults("cluster_check", ClusterCheckConfig)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("cluster_check", overrides=overrides)
    pipeline = ClusterCheckPipeline(load_pipeline_config(cfg, ClusterCheckConfig, yaml_names([CONFIG_DIR])))
    try:
        report = pipeline.run()
        addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}

        def where(worker: object) -> dict[str, str]:
            keys = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
            return {k: os.environ[k] for k in keys} | {"node": ray.get_runtime_context().get_node_id()}

        ranks: dict[str, object] = {"report": report}
        for name, cluster in pipeline.clusters.items():
            envs = ray.get([w.__ray_call__.remote(where) for w in cluster.workers])
            ranks[name] = [env | {"ip": addresses[env["node"]]} for env in envs]
    finally:
        pipeline.shutdown()
    return ranks


if __name__ == "__main__":
    print(RESULT + json.dumps({"ranks": ranks_scenario}[sys.argv[1]](), default=str), flush=True)
