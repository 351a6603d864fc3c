"""Check a Ray cluster and a device mapping: `python examples/start_cluster_check.py [overrides]`."""

import hydra
from omegaconf import DictConfig

from roll.configs.hydra_defaults import register_schema_defaults
from roll.pipeline.cluster_check.cluster_check_config import ClusterCheckConfig
from roll.pipeline.cluster_check.cluster_check_pipeline import ClusterCheckPipeline
from roll.pipeline.entry import run_pipeline

register_schema_defaults("cluster_check", ClusterCheckConfig)


@hydra.main(config_path="config", config_name="cluster_check", version_base=None)
def main(cfg: DictConfig) -> None:
    """Compose the YAML, validate it, run the check."""
    run_pipeline(cfg, ClusterCheckConfig, ClusterCheckPipeline)


if __name__ == "__main__":
    main()
