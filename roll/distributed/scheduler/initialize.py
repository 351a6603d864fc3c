"""Connecting to Ray: an existing cluster when one is named, otherwise an embedded local one."""

from __future__ import annotations

import logging
import os

import ray

logger = logging.getLogger(__name__)

# Variables every Ray worker process inherits: one BLAS thread unless a worker raises its own cap,
# and the platform the driver resolved.
_INHERITED_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE")


def init_ray(address: str | None, namespace: str, num_cpus: int | None, platform_name: str) -> None:
    """Connect to `address` (or `$RAY_ADDRESS`) if given, else start Ray in this process.

    `num_cpus` sizes an embedded Ray's logical CPUs (it may exceed the physical cores: CPU device
    slots are accounting, and workers cap their own threads). It is ignored for an existing cluster,
    whose resources are its own. Calling this when Ray is already up does nothing.
    """
    if ray.is_initialized():
        return
    env_vars = {"ROLL_PLATFORM": platform_name, "RAY_USAGE_STATS_ENABLED": "0"}
    env_vars.update({k: os.environ[k] for k in _INHERITED_ENV if k in os.environ})
    env_vars.setdefault("OMP_NUM_THREADS", "1")
    target = address or os.environ.get("RAY_ADDRESS")
    runtime_env = {"env_vars": env_vars}
    if target:
        logger.info("connecting to the Ray cluster at %s", target)
        ray.init(address=target, namespace=namespace, runtime_env=runtime_env, log_to_driver=True)
    else:
        logger.info("starting an embedded Ray with %s logical CPUs", num_cpus)
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
