"""Run the offline distillation pipeline: `python examples/start_distill_pipeline.py [--config-name NAME] [overrides]`.

The same as the installed command `roll-distill`, with the YAML of this folder's `config/`.
"""

from pathlib import Path

from roll.cli import main

if __name__ == "__main__":
    main("distill", config_dir=Path(__file__).resolve().parent / "config")
