"""Run the Reward FL pipeline: `python examples/start_reward_fl_pipeline.py [--config-name NAME] [overrides]`.

The same as the installed command `roll-reward-fl`, with the YAML of this folder's `config/`.
"""

from pathlib import Path

from roll.cli import main

if __name__ == "__main__":
    main("reward_fl", config_dir=Path(__file__).resolve().parent / "config")
