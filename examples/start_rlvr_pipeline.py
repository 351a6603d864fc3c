"""Run the RLVR pipeline: `python examples/start_rlvr_pipeline.py [--config-name NAME] [overrides]`."""

import hydra
from omegaconf import DictConfig

from roll.configs.hydra_defaults import register_schema_defaults
from roll.pipeline.entry import run_pipeline
from roll.pipeline.rlvr.rlvr_config import RLVRConfig
from roll.pipeline.rlvr.rlvr_pipeline import RLVRPipeline

register_schema_defaults("rlvr", RLVRConfig)


@hydra.main(config_path="config", config_name="rlvr_arithmetic", version_base=None)
def main(cfg: DictConfig) -> None:
    """Compose the YAML, validate it, run the pipeline."""
    run_pipeline(cfg, RLVRConfig, RLVRPipeline)


if __name__ == "__main__":
    main()
