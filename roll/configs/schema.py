"""Strict conversion of plain YAML data into typed config dataclasses.

Hydra composes the YAML; this module turns the composed mapping into dataclasses, once, at the entry
point. Unknown keys and values of the wrong type are errors that name the dotted field path and, for
a misspelt key, the closest valid spelling. Values are never rewritten to fit.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, TypeVar, Union

T = TypeVar("T")


class ConfigError(ValueError):
    """A user-facing configuration error whose message names the field and the override that fixes it."""


def closest_spelling(word: str, valid: typing.Iterable[str]) -> str:
    """' (did you mean X?)' for the closest valid spelling of `word`, or '' when none is close."""
    matches = difflib.get_close_matches(word, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {matches[0]!r}?)" if matches else ""


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass `cls` from a mapping, recursing into nested dataclasses, strictly."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{path or cls.__name__}: expected a mapping for {cls.__name__}, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            where = f"{path}.{key}" if path else str(key)
            raise ConfigError(f"unknown config key {where!r}{closest_spelling(str(key), fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {name: _convert(hints[name], value, _join(path, name)) for name, value in data.items()}
    return cls(**kwargs)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Check `value` against type `tp` and convert nested mappings; raise ConfigError on mismatch."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, path)
            except ConfigError as exc:
                errors.append(exc)
        raise ConfigError(f"{path}: {value!r} is not a valid {_type_name(tp)}") from errors[0]
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(map(repr, allowed))}")
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin is list:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (item_type,) = typing.get_args(tp) or (Any,)
        return [_convert(item_type, item, f"{path}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        _, value_type = typing.get_args(tp) or (Any, Any)
        return {k: _convert(value_type, v, _join(path, str(k))) for k, v in value.items()}
    return _check_scalar(tp, value, path)


def _check_scalar(tp: type, value: Any, path: str) -> Any:
    # bool is an int subclass and ints are acceptable floats; nothing else is coerced.
    ok = (
        isinstance(value, bool)
        if tp is bool
        else isinstance(value, int | float) and not isinstance(value, bool)
        if tp is float
        else isinstance(value, tp) and not (tp is int and isinstance(value, bool))
    )
    if not ok:
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
    return float(value) if tp is float else value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
