"""Console entry points of the package: `roll-rlvr`, `roll-agentic`, `roll-sft`, `roll-dpo`, `roll-rm`,
`roll-distill`, `roll-reward-fl` and `roll-cluster-check`.

Each takes the Hydra arguments of its `examples/start_*.py` twin (overrides, `--config-name`,
`--config-dir`, `-m` sweeps, and `-v` for the run's detail on the console: short for `hydra.verbose=roll`) and
runs from any working directory. The YAML comes from the
repository's `examples/config/` (the package is installed editable); with another install, point
Hydra at a config directory with `--config-path`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NamedTuple, NoReturn

import hydra
from omegaconf import DictConfig

from roll.configs.hydra_defaults import register_schema_defaults
from roll.configs.loader import check_yaml_files
from roll.configs.schema import ConfigError, exit_on_config_error
from roll.pipeline.base.entry import run_pipeline
from roll.utils.console import verbose_args
from roll.utils.imports import import_object
from roll.utils.process_exit import run_as_program

CONFIG_DIR = Path(__file__).resolve().parent.parent / "examples" / "config"


class Entry(NamedTuple):
    """A pipeline as a command: its schema, its driver (dotted paths, imported only for the command that runs them:
    each pipeline's modules cost a driver seconds of imports) and the YAML it composes by default."""

    schema: str
    pipeline_cls: str
    config_name: str


ENTRIES = {
    "rlvr": Entry(
        "roll.pipeline.rlvr.rlvr_config.RLVRConfig", "roll.pipeline.rlvr.rlvr_pipeline.RLVRPipeline", "rlvr_arithmetic"
    ),
    # Agentic RL is the RLVR pipeline with an `env:` block (roll.pipeline.agentic holds its multi-turn rollout).
    "agentic": Entry(
        "roll.pipeline.rlvr.rlvr_config.RLVRConfig",
        "roll.pipeline.rlvr.rlvr_pipeline.RLVRPipeline",
        "agentic_calculator",
    ),
    "sft": Entry(
        "roll.pipeline.sft.sft_config.SFTConfig", "roll.pipeline.sft.sft_pipeline.SFTPipeline", "sft_arithmetic"
    ),
    "dpo": Entry(
        "roll.pipeline.dpo.dpo_config.DPOConfig", "roll.pipeline.dpo.dpo_pipeline.DPOPipeline", "dpo_arithmetic"
    ),
    "rm": Entry("roll.pipeline.rm.rm_config.RMConfig", "roll.pipeline.rm.rm_pipeline.RMPipeline", "rm_arithmetic"),
    "distill": Entry(
        "roll.pipeline.distill.distill_config.DistillConfig",
        "roll.pipeline.distill.distill_pipeline.DistillPipeline",
        "distill_arithmetic",
    ),
    "reward_fl": Entry(
        "roll.pipeline.diffusion.reward_fl_config.RewardFLConfig",
        "roll.pipeline.diffusion.reward_fl_pipeline.RewardFLPipeline",
        "reward_fl_shapes",
    ),
    "cluster_check": Entry(
        "roll.pipeline.cluster_check.cluster_check_config.ClusterCheckConfig",
        "roll.pipeline.cluster_check.cluster_check_pipeline.ClusterCheckPipeline",
        "cluster_check",
    ),
}


def main(name: str, config_dir: Path = CONFIG_DIR) -> NoReturn:
    """Pipeline `name` as a program (a console script, an `examples/start_*.py`): `run_entry`, then the end of the
    process with its exit status, skipping the interpreter's teardown (roll.utils.process_exit)."""
    run_as_program(lambda: run_entry(name, config_dir))


def run_entry(name: str, config_dir: Path = CONFIG_DIR) -> None:
    """Compose the YAML from the command line's Hydra arguments, validate it, run pipeline `name`.

    The schema's defaults are registered as the `<name>_schema` node the YAML lists first. Every YAML file
    of the config directories must parse first: a config error naming the file and line otherwise.
    """
    entry = ENTRIES[name]
    sys.argv[1:] = verbose_args(sys.argv[1:])  # `-v`: the run's detail on the console (hydra.verbose=roll)
    try:
        check_yaml_files([config_dir, *config_dirs_given(sys.argv[1:])])
    except ConfigError as exc:
        exit_on_config_error(exc)
    schema, pipeline_cls = import_object(entry.schema, name), import_object(entry.pipeline_cls, name)
    # Entries sharing the schema share its node under each name (an agentic YAML lists `agentic_schema`, and
    # `roll-rlvr --config-name agentic_calculator` runs the same pipeline as `roll-agentic`).
    for other in [name, *(n for n, e in ENTRIES.items() if n != name and e.schema == entry.schema)]:
        register_schema_defaults(other, schema)

    def task(cfg: DictConfig) -> None:
        run_pipeline(cfg, schema, pipeline_cls)

    hydra.main(config_path=str(config_dir), config_name=entry.config_name, version_base=None)(task)()


def config_dirs_given(args: list[str]) -> list[str]:
    """The config directories Hydra's command-line `args` add (`--config-dir`, `-cd`) or use (`--config-path`,
    `-cp`)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--config-dir", "-cd")
    parser.add_argument("--config-path", "-cp")
    given, _ = parser.parse_known_args(args)
    return [d for d in (given.config_dir, given.config_path) if d]


def rlvr() -> NoReturn:
    """`roll-rlvr`: the RLVR pipeline (GRPO and friends), by default on the arithmetic task."""
    main("rlvr")


def agentic() -> NoReturn:
    """`roll-agentic`: multi-turn agentic RL in an environment, by default the calculator tool task."""
    main("agentic")


def sft() -> NoReturn:
    """`roll-sft`: supervised fine-tuning, by default the arithmetic warm start."""
    main("sft")


def dpo() -> NoReturn:
    """`roll-dpo`: direct preference optimisation, by default on arithmetic pairs (the correct answer preferred)."""
    main("dpo")


def rm() -> NoReturn:
    """`roll-rm`: reward-model training (Bradley-Terry), by default on arithmetic pairs (the correct answer chosen)."""
    main("rm")


def distill() -> NoReturn:
    """`roll-distill`: offline knowledge distillation, by default of the main job's policy into a smaller tiny model."""
    main("distill")


def reward_fl() -> NoReturn:
    """`roll-reward-fl`: Reward FL of a diffusion model, by default the tiny model's shapes turned red on CPU."""
    main("reward_fl")


def cluster_check() -> NoReturn:
    """`roll-cluster-check`: collectives and every dispatch mode on two roles of a device mapping."""
    main("cluster_check")
