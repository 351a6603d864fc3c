"""Every schema field as a Hydra defaults node, so any field can be overridden without `+`.

Hydra refuses `key=value` for a key its composed config lacks. A pipeline YAML lists
`<name>_schema` first in its defaults list; that node holds every field of the pipeline's schema
with its default, roles included, and the YAML then sets what it needs. An optional role the YAML
does not use may be set to `null` there or left out (the loader drops a block left at these
defaults). Strictness stays with `roll.configs.loader`: this node only supplies keys, it does not
validate.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union

from hydra.core.config_store import ConfigNode, ConfigStore


def schema_defaults(schema: type, instance: Any = None) -> dict[str, Any]:
    """Defaults of `schema` (or the values of `instance`) as plain data, nested dataclasses expanded.

    A field typed as an optional dataclass whose default is None is expanded with that dataclass's
    own defaults, so its keys exist for overrides.
    """
    instance = schema() if instance is None else instance
    hints = typing.get_type_hints(schema)
    defaults: dict[str, Any] = {}
    for f in dataclasses.fields(schema):
        if not f.init:
            continue
        value = getattr(instance, f.name)
        nested = dataclass_in(hints[f.name])
        if nested is None:
            defaults[f.name] = _plain(value)
        else:
            defaults[f.name] = schema_defaults(nested, value if isinstance(value, nested) else None)
    return defaults


def _plain(value: Any) -> Any:
    """Dataclass instances inside containers as plain dicts (OmegaConf would type-check them)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return schema_defaults(type(value), value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def dataclass_in(tp: Any) -> type | None:
    """The dataclass type `tp` names, directly or as an option of a union (`X | None`), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (Union, types.UnionType):
        found = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        return found[0] if found else None
    return None


# Where Hydra writes, for every pipeline: a single run's Hydra files beside its outputs' folder, and
# each job of a sweep (`-m`) in a folder of its own under the run's, which the pipeline then writes
# to (`run_dir`), so sibling jobs never overwrite each other and nothing lands in the working directory.
# Before Hydra writes there, a callback checks that those folders and output_dir can be written.
HYDRA_OUTPUT = {
    "run": {"dir": "${output_dir}/hydra/${exp_name}/${now:%Y%m%d-%H%M%S}"},
    "sweep": {"dir": "${output_dir}/${exp_name}/sweep-${now:%Y%m%d-%H%M%S}", "subdir": "${hydra.job.num}"},
    "callbacks": {"writable_output": {"_target_": "roll.configs.output_dirs.WritableOutput"}},
    # No Hydra log handlers: the run sets up its console and its log file, <run_dir>/logs/run.log, itself
    # (roll/utils/console.py; `hydra.verbose` still sets what the run shows).
    "job_logging": {"root": None},
}


# The node each `register_schema_defaults` call stored last, with the schema it holds: storing converts the whole
# schema into an OmegaConf node (about 0.1 CPU-second), which a process composing many configs need not repeat.
_stored: dict[str, tuple[type, ConfigNode]] = {}


def register_schema_defaults(config_name: str, schema: type) -> str:
    """Store `schema`'s defaults (and Hydra's output layout) in Hydra's ConfigStore as `<config_name>_schema`,
    unless the store still holds the node an earlier call made for the same schema.

    Returns the node's name.
    """
    node_name = f"{config_name}_schema"
    store = ConfigStore.instance()
    repo = store.repo
    stored = _stored.get(node_name)
    if stored is not None and stored[0] is schema and repo.get(f"{node_name}.yaml") is stored[1]:
        return node_name  # Hydra deep-copies a node on each load, so the stored one is as it was made
    hydra = HYDRA_OUTPUT | {"job": {"chdir": False, "name": config_name}}  # the job's name in Hydra's records
    store.store(name=node_name, node={"hydra": hydra, **schema_defaults(schema)})
    _stored[node_name] = (schema, repo[f"{node_name}.yaml"])
    return node_name
