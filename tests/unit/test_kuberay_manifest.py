"""The KubeRay manifest runs as shipped: the Dockerfile's image, a shared volume, and every GPU it asks for in use."""

from __future__ import annotations

import re

import yaml

from roll.configs.device_mapping import ALL_DEVICES
from roll.pipeline.base.fault_tolerance_config import FaultToleranceArguments
from tests.conftest import CONFIG_DIR, REPO_ROOT

JOB = yaml.safe_load((REPO_ROOT / "examples" / "kuberay" / "rayjob.yaml").read_text())
CLUSTER = JOB["spec"]["rayClusterSpec"]


def _pods() -> list[dict]:
    return [CLUSTER["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in CLUSTER["workerGroupSpecs"]]


def _overrides() -> dict[str, str]:
    return dict(arg.split("=", 1) for arg in JOB["spec"]["entrypoint"].split() if "=" in arg)


def test_every_gpu_the_workers_hold_is_used_by_the_recipe() -> None:
    gpus = sum(
        group["replicas"] * int(container["resources"]["limits"].get("nvidia.com/gpu", 0))
        for group in CLUSTER["workerGroupSpecs"]
        for container in group["template"]["spec"]["containers"]
    )
    overrides = _overrides()
    assert int(overrides["num_nodes"]) * int(overrides["devices_per_node"]) == gpus
    entry = JOB["spec"]["entrypoint"].split()
    recipe = yaml.safe_load((CONFIG_DIR / f"{entry[entry.index('--config-name') + 1]}.yaml").read_text())
    for role in ("actor_train", "actor_infer", "reference"):
        assert recipe[role]["device_mapping"] == ALL_DEVICES, role


def test_every_pod_runs_the_dockerfiles_cuda_image_and_mounts_the_shared_volume() -> None:
    tag = re.search(r"docker build --target cuda -t (\S+) \.", (REPO_ROOT / "Dockerfile").read_text())
    assert tag is not None
    images = {c["image"] for pod in _pods() for c in pod["containers"]}
    assert len(images) == 1 and images.pop().endswith(tag.group(1).split("/")[-1])
    for pod in _pods():
        claims = {v["name"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        for container in pod["containers"]:
            mounted = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
            assert claims and all(mounted.get(name) == "/data" for name in claims)
    assert all(value.startswith("/data/") for key, value in _overrides().items() if "file" in key or "dir" in key)


def test_the_job_resumes_by_itself_after_a_stop_or_a_lost_worker() -> None:
    """Lost workers restart the roles; a head pod being deleted stops the run with a checkpoint (preStop SIGTERM,
    within the grace period), and the retried job resumes from it."""
    overrides = _overrides()
    assert overrides["resume_from_checkpoint"] == "auto" and int(overrides["fault_tolerance.max_restarts"]) >= 1
    assert JOB["spec"]["backoffLimit"] >= 1
    head = CLUSTER["headGroupSpec"]["template"]["spec"]
    assert head["terminationGracePeriodSeconds"] > FaultToleranceArguments().preemption_deadline_s
    stop = head["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-1]
    assert stop.startswith("pkill -TERM -f 'examples/start_';") and JOB["spec"]["entrypoint"].startswith(
        "python examples/start_"
    )
