"""Run the reward-model pipeline: `python examples/start_rm_pipeline.py [--config-name NAME] [overrides]`.

The same as the installed command `roll-rm`, with the YAML of this folder's `config/`.
"""

from pathlib import Path

from roll.cli import main

if __name__ == "__main__":
    main("rm", config_dir=Path(__file__).resolve().parent / "config")
