"""From a Hydra-composed config to a validated pipeline dataclass, in one call at the entry point."""

from __future__ import annotations

import re
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from roll.configs.hydra_defaults import dataclass_in, schema_defaults
from roll.configs.schema import ConfigError, from_dict


class Validated(Protocol):
    """A config dataclass that checks itself (a pipeline config)."""

    def validate(self) -> None: ...


P = TypeVar("P", bound=Validated)
_INTERPOLATION_ROOT = re.compile(r"\$\{\s*([A-Za-z_][\w-]*)")


def yaml_names(config_dirs: Iterable[str | Path]) -> set[str]:
    """Names of the YAML files in `config_dirs`: the shared blocks a pipeline may pull in."""
    return {p.stem for d in config_dirs for p in Path(d).glob("*.yaml")}


def check_yaml_files(config_dirs: Iterable[str | Path]) -> None:
    """Every YAML file in `config_dirs` and their subfolders (Hydra's config groups) parses, else a ConfigError
    naming the file, the line and the column (Hydra would end with a traceback)."""
    for directory in map(Path, config_dirs):
        for path in sorted([*directory.glob("*.yaml"), *directory.glob("*/*.yaml")]):
            try:
                OmegaConf.load(path)
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
                context = f" ({exc.context})" if getattr(exc, "context", None) else ""
                problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
                raise ConfigError(f"{path}{where} does not parse as YAML: {problem}{context}") from exc


def load_pipeline_config(cfg: DictConfig | dict[str, Any], schema: type[P], block_names: Iterable[str] = ()) -> P:
    """Resolve interpolations, convert strictly to `schema`, validate; raise ConfigError on bad input.

    Top-level mappings that are not schema fields are shared blocks (such as those pulled in from
    `examples/config/deepspeed_zero*.yaml` and referenced as `strategy_config: ${deepspeed_zero3}`)
    when something references them or their name is in `block_names` (the YAML files beside the
    pipeline's). Any other unknown top-level key is an error.
    """
    cfg = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    raw = OmegaConf.to_container(cfg, resolve=False)
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot resolve the config: {exc}".splitlines()[0]) from exc
    schema_fields = set(schema.__dataclass_fields__)
    known_blocks = set(_INTERPOLATION_ROOT.findall(str(raw))) | set(block_names)
    shared_blocks = {
        key
        for key, value in resolved.items()
        if key not in schema_fields and key in known_blocks and isinstance(value, dict)
    }
    _drop_untouched_optional_blocks(schema, resolved)
    config = from_dict(schema, {k: v for k, v in resolved.items() if k not in shared_blocks})
    config.validate()
    return config


def _drop_untouched_optional_blocks(schema: type, resolved: dict[str, Any]) -> None:
    """An optional block (`critic: WorkerConfig | None = None`) still at the defaults Hydra's schema node
    expanded it with was never set: it becomes None, as if the YAML said `critic: null`."""
    hints = typing.get_type_hints(schema)
    for name, field in schema.__dataclass_fields__.items():
        nested = dataclass_in(hints[name])
        if nested is not None and field.default is None and resolved.get(name) == schema_defaults(nested):
            resolved[name] = None
