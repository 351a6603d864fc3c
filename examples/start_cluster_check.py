"""Check a Ray cluster and a device mapping: `python examples/start_cluster_check.py [--config-name NAME] [overrides]`.

The same as the installed command `roll-cluster-check`, with the YAML of this folder's `config/`.
"""

from pathlib import Path

from roll.cli import main

if __name__ == "__main__":
    main("cluster_check", config_dir=Path(__file__).resolve().parent / "config")
