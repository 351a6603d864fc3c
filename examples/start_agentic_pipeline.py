"""Run agentic RL: `python examples/start_agentic_pipeline.py [--config-name NAME] [overrides]`.

The same as the installed command `roll-agentic` (the RLVR pipeline with an `env:` block, by default
`agentic_calculator`), with the YAML of this folder's `config/`.
"""

from pathlib import Path

from roll.cli import main

if __name__ == "__main__":
    main("agentic", config_dir=Path(__file__).resolve().parent / "config")
