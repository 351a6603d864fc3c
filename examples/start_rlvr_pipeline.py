"""Run the RLVR pipeline: `python examples/start_rlvr_pipeline.py [--config-name NAME] [overrides]`.

The same as the installed command `roll-rlvr`, with the YAML of this folder's `config/`.
"""

from pathlib import Path

from roll.cli import main

if __name__ == "__main__":
    main("rlvr", config_dir=Path(__file__).resolve().parent / "config")
