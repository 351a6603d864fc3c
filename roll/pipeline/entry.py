"""Shared body of the `examples/start_*.py` entry points."""

from __future__ import annotations

import logging
import sys
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from roll.configs.loader import load_pipeline_config, yaml_names
from roll.configs.schema import ConfigError
from roll.pipeline.base_config import PipelineConfig


def run_pipeline(cfg: DictConfig, schema: type[PipelineConfig], pipeline_cls: type) -> Any:
    """Validate `cfg` against `schema`, run the pipeline, always shut it down.

    A configuration error ends the program with its one-line message and exit code 2, before any
    Ray actor starts.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_pipeline_config(cfg, schema, yaml_names(_config_dirs()))
        pipeline = pipeline_cls(config)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    try:
        return pipeline.run()
    finally:
        pipeline.shutdown()


def _config_dirs() -> list[str]:
    """The file directories Hydra composed this run's config from."""
    return [s.path for s in HydraConfig.get().runtime.config_sources if s.schema == "file"]
