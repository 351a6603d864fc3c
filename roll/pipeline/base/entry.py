"""Shared body of the `examples/start_*.py` entry points."""

from __future__ import annotations

import logging
import sys
from typing import Any

import ray
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from roll.configs.loader import load_pipeline_config, yaml_names
from roll.configs.schema import ConfigError, exit_on_config_error
from roll.distributed.executor.cluster import WorkerDiedError
from roll.distributed.scheduler.placement import PlacementError
from roll.pipeline.base.dry_run.node_estimate import check_node_memory
from roll.pipeline.base.dry_run.plan import cluster_nodes, dry_run_report
from roll.pipeline.base.pipeline_config import PipelineConfig

# After a failure, workers may be stuck in a collective with a dead peer: do not wait long for them to close.
FAILED_RUN_CLOSE_TIMEOUT_S = 5.0


def run_pipeline(cfg: DictConfig, schema: type[PipelineConfig], pipeline_cls: type) -> Any:
    """Validate `cfg` against `schema`, run the pipeline, always shut it down (`dry_run`: print the plan instead).

    A configuration error ends the program with its one-line message and exit code 2, before any
    Ray actor starts; so does a placement error (a Ray cluster too small for what the roles ask, or a
    reservation Ray did not grant within `placement_timeout_s`), with its one-paragraph message. A
    worker that dies mid-run ends it with exit code 1 and a message naming the role, rank and node;
    the other workers then get a few seconds to close before they are killed (some may wait in a
    collective with the dead one).
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    hydra = HydraConfig.get()
    if hydra.mode == RunMode.MULTIRUN and not cfg.get("run_dir"):
        cfg.run_dir = hydra.runtime.output_dir  # this sweep job's own folder, so its siblings' outputs survive
    try:
        config = load_pipeline_config(cfg, schema, yaml_names(_config_dirs()))
        if config.dry_run:
            print("\n".join(dry_run_report(config, cluster_nodes(config))), flush=True)
            check_node_memory(config)  # a plan that will not fit ends as the run would: a config error
            return None
        check_node_memory(config)
        finished = pipeline_cls.finished_result(config)
        if finished is not None:
            return finished
        pipeline = pipeline_cls(config)
    except PlacementError as exc:
        print(f"placement error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except ConfigError as exc:
        exit_on_config_error(exc)
    try:
        result = pipeline.run()
    except WorkerDiedError as exc:
        pipeline.shutdown(close_timeout_s=FAILED_RUN_CLOSE_TIMEOUT_S)
        ray.shutdown()  # ends the forwarding of worker logs, so the message below is the output's last word
        print(
            f"run failed: {exc}\nThe other workers were stopped. Resume with resume_from_checkpoint=latest "
            "(the last complete checkpoint) once the cause is fixed.",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)
    except BaseException:
        pipeline.shutdown(close_timeout_s=FAILED_RUN_CLOSE_TIMEOUT_S)
        raise
    pipeline.shutdown()
    return result


def _config_dirs() -> list[str]:
    """The file directories Hydra composed this run's config from."""
    return [s.path for s in HydraConfig.get().runtime.config_sources if s.schema == "file"]
