"""Shared body of the `examples/start_*.py` entry points."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, NoReturn

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
from roll.pipeline.base.preemption import PREEMPTED_EXIT_CODE, Preempted, StopSignals
from roll.pipeline.base.recovery import Restarts
from roll.utils.console import RunLogs, debug_loggers, run_logging

logger = logging.getLogger(__name__)

# After a failure, workers may be stuck in a collective with a dead peer: do not wait long for them to close.
FAILED_RUN_CLOSE_TIMEOUT_S = 5.0


def run_pipeline(cfg: DictConfig, schema: type[PipelineConfig], pipeline_cls: type) -> Any:
    """Validate `cfg` against `schema`, run the pipeline, always shut it down (`dry_run`: print the plan instead).

    A configuration error ends the program with its one-line message and exit code 2, before any
    Ray actor starts; so does a placement error (a Ray cluster too small for what the roles ask, or a
    reservation Ray did not grant within `placement_timeout_s`), with its one-paragraph message. A
    worker that dies mid-run stops every role (the other workers get a few seconds to close before they
    are killed: some may wait in a collective with the dead one); with `fault_tolerance.max_restarts`
    left, the roles start again from the last complete checkpoint (roll/pipeline/base/recovery.py),
    else the run ends with exit code 1 and a message naming the role, rank and node. SIGTERM or SIGINT
    end it after its current step with a checkpoint and exit code PREEMPTED_EXIT_CODE (75).

    The console shows the plan, progress, milestones, warnings and errors; the rest goes to
    `<run_dir>/logs/run.log` (and the workers' to `workers.log` beside it), which the plan names.
    Hydra's `hydra.verbose` (`-v`) shows the detail on the console too (roll/utils/console.py).
    """
    hydra = HydraConfig.get()
    if hydra.mode == RunMode.MULTIRUN and not cfg.get("run_dir"):
        cfg.run_dir = hydra.runtime.output_dir  # this sweep job's own folder, so its siblings' outputs survive
    debug = debug_loggers(hydra.verbose)
    with run_logging(verbose=bool(debug), debug_loggers=debug) as logs:
        return _run(cfg, schema, pipeline_cls, logs)


def _run(cfg: DictConfig, schema: type[PipelineConfig], pipeline_cls: type, logs: RunLogs) -> Any:
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
        log_file = logs.to_file(Path(config.run_dir) / "logs" / "run.log", " ".join(sys.argv))
        print("\n".join(run_plan(config, log_file, logs.verbose)), flush=True)
    except ConfigError as exc:
        exit_on_config_error(exc)
    fault_tolerance = getattr(config, "fault_tolerance", None)
    signals = StopSignals(fault_tolerance.preemption_deadline_s) if fault_tolerance else None
    restarts = Restarts(config)
    death: WorkerDiedError | None = None
    try:
        while True:
            try:
                return _run_once(pipeline_cls, config, signals, restarts, logs)
            except WorkerDiedError as exc:
                death = exc
                if not restarts.left:
                    raise
                config = restarts.next_config(config, exc)
            except PlacementError as exc:
                if death is None or not restarts.wait_for_placement(exc):
                    raise
    except PlacementError as exc:
        if death is None:
            print(f"placement error: {exc}", file=sys.stderr, flush=True)
            sys.exit(2)
        _exit_failed(f"{death}\nThe roles did not fit again after it: {exc}", logs)
    except ConfigError as exc:
        exit_on_config_error(exc)
    except WorkerDiedError as exc:
        _exit_failed(str(exc), logs)
    except Preempted as exc:
        ray.shutdown()
        print(
            f"run preempted: {exc}. Exit status {PREEMPTED_EXIT_CODE}: resume with resume_from_checkpoint=latest "
            f"(the last complete checkpoint). The detail is in {logs.path}.",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(PREEMPTED_EXIT_CODE)
    finally:
        if signals is not None:
            signals.restore()


def _run_once(
    pipeline_cls: type, config: PipelineConfig, signals: StopSignals | None, restarts: Restarts, logs: RunLogs
) -> Any:
    """Start the pipeline and run it; shut it down however it ends (after a failure, without waiting long)."""
    if signals is not None:
        signals.install()  # a signal while the roles start stops the run after its first step
    pipeline = pipeline_cls(config)
    if signals is not None:
        signals.install()  # again: Ray's start set a SIGTERM handler of its own
        pipeline.stop_signals = signals
    if restarts.done:
        pipeline.fault_metrics = restarts.restarted()
    try:
        result = pipeline.run()
    except BaseException:
        pipeline.shutdown(close_timeout_s=FAILED_RUN_CLOSE_TIMEOUT_S)
        raise
    pipeline.shutdown()
    return result


def _exit_failed(reason: str, logs: RunLogs) -> NoReturn:
    """End a run whose worker died (no restart left): Ray stopped, the reason and how to resume, exit code 1."""
    ray.shutdown()  # ends the forwarding of worker logs, so the message below is the output's last word
    print(
        f"run failed: {reason}\nThe other workers were stopped. Resume with resume_from_checkpoint=latest "
        f"(the last complete checkpoint) once the cause is fixed. The detail is in {logs.path}.",
        file=sys.stderr,
        flush=True,
    )
    sys.exit(1)


def run_plan(config: PipelineConfig, log_file: Path, verbose: bool) -> list[str]:
    """What a run prints before it starts: its roles and where they run, the size of a step (the whole batch
    arithmetic goes to the log file, as `dry_run=true` prints it), where its outputs and its detail go."""
    steps = getattr(config, "max_steps", None)
    where = f"{config.num_nodes} node(s) x {config.devices_per_node} {config.platform} device(s)"
    batches = config.batch_plan()
    for line in batches:
        logger.info("batches: %s", line)
    detail = "" if verbose else " (-v shows it here)"
    return [
        f"{config.exp_name}: {', '.join(config.roles())} on {where}" + (f", {steps} steps" if steps else ""),
        *(f"  {line}" for line in batches[:1]),
        f"outputs in {config.run_dir}; the detail in {log_file}{detail}",
    ]


def _config_dirs() -> list[str]:
    """The file directories Hydra composed this run's config from."""
    return [s.path for s in HydraConfig.get().runtime.config_sources if s.schema == "file"]
