"""Connecting to Ray: an existing cluster when one is named, otherwise an embedded local one."""

from __future__ import annotations

import logging
import os

import ray

from roll.utils.console import worker_env

logger = logging.getLogger(__name__)

# Variables every Ray worker process inherits: one BLAS thread unless a worker raises its own cap,
# and the platform the driver resolved.
_INHERITED_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "DS_ACCELERATOR")
# Settings of the Ray daemons a local Ray starts, read from the environment when they start. Each spares CPU that
# a small machine's run needs (measured in docs/testing.md, "Ray's own processes"); a variable already set wins.
LOCAL_RAY_ENV = {
    # No Python workers started ahead of demand: a run's actors start their own, and the pre-started ones idled
    # after importing Ray (about 3 CPU-seconds each).
    "RAY_prestart_worker_first_driver": "0",
    "RAY_enable_worker_prestart": "0",
    # The log monitor lists the log folder every 0.5 s instead of every 0.1 s while it holds under 1000 files.
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    # No metrics for a Prometheus that an embedded Ray has no dashboard to serve.
    "RAY_enable_metrics_collection": "0",
}


def use_local_ray_settings() -> None:
    """Put LOCAL_RAY_ENV into this process's environment, for the Ray daemons it starts, where not set already."""
    for name, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(name, value)


def init_ray(address: str | None, namespace: str, num_cpus: int | None, platform_name: str) -> None:
    """Connect to `address` (or `$RAY_ADDRESS`) if given, else start Ray in this process.

    `num_cpus` sizes an embedded Ray's logical CPUs (it may exceed the physical cores: CPU device
    slots are accounting, and workers cap their own threads). It is ignored for an existing cluster,
    whose resources are its own. Calling this when Ray is already up does nothing.
    """
    if ray.is_initialized():
        return
    if platform_name == "cpu":
        # DeepSpeed's accelerator named, not detected (here and in every worker): a detection that finds no GPU
        # warns in each process that imports DeepSpeed.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    env_vars = {"ROLL_PLATFORM": platform_name, "RAY_USAGE_STATS_ENABLED": "0"}
    env_vars.update({k: os.environ[k] for k in _INHERITED_ENV if k in os.environ})
    env_vars.setdefault("OMP_NUM_THREADS", "1")
    # Workers start with their libraries quiet and know where the run's log file is (roll/utils/console.py).
    env_vars.update(worker_env())
    target = address or os.environ.get("RAY_ADDRESS")
    runtime_env = {"env_vars": env_vars}
    if target:
        logger.info("connecting to the Ray cluster at %s", target)
        ray.init(address=target, namespace=namespace, runtime_env=runtime_env, log_to_driver=True)
    else:
        logger.info("starting an embedded Ray with %s logical CPUs", num_cpus)
        use_local_ray_settings()
        ray.init(
            # "local" starts a new Ray even when another one runs on this machine (without it, Ray joins the
            # last cluster `ray start` launched here, which is not the embedded Ray the run asked for).
            address="local",
            num_cpus=num_cpus,
            namespace=namespace,
            runtime_env=runtime_env,
            include_dashboard=False,
            log_to_driver=True,
        )
