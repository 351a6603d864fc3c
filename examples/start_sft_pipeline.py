"""Run the SFT pipeline: `python examples/start_sft_pipeline.py [--config-name NAME] [overrides]`."""

import hydra
from omegaconf import DictConfig

from roll.configs.hydra_defaults import register_schema_defaults
from roll.pipeline.entry import run_pipeline
from roll.pipeline.sft.sft_config import SFTConfig
from roll.pipeline.sft.sft_pipeline import SFTPipeline

register_schema_defaults("sft", SFTConfig)


@hydra.main(config_path="config", config_name="sft_arithmetic", version_base=None)
def main(cfg: DictConfig) -> None:
    """Compose the YAML, validate it, run the pipeline."""
    run_pipeline(cfg, SFTConfig, SFTPipeline)


if __name__ == "__main__":
    main()
