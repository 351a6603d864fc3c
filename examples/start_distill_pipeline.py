"""Run the offline distillation pipeline: `python examples/start_distill_pipeline.py [--config-name NAME] [overrides]`.

The same as the installed command `roll-distill`, with the YAML of this folder's `config/`.
"""

from pathlib import Path

from roll.cli import run_entry

if __name__ == "__main__":
    run_entry("distill", config_dir=Path(__file__).resolve().parent / "config")
