"""Strict conversion of plain YAML data into typed config dataclasses.

Hydra composes the YAML; this module turns the composed mapping into dataclasses, once, at the entry
point. Unknown keys and values of the wrong type are errors that name the dotted field path and, for
a misspelt key, the closest valid spelling. Values are never rewritten to fit.

Beyond its type, a field declares what values it accepts with a `Rule` in its metadata (`check`,
`any_value`, `checked_in_validate`); `from_dict` enforces it on every value it converts, so a value
out of range is a one-line ConfigError naming the field, the value and the valid range. Relations
between fields, and checks that need the filesystem or the machine, are the pipeline config's
`validate()`.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar, Union

T = TypeVar("T")


class ConfigError(ValueError):
    """A user-facing configuration error whose message names the field and the override that fixes it."""


def exit_on_config_error(exc: ConfigError) -> NoReturn:
    """End the program as every configuration error does: `config error: <message>` on stderr, exit code 2."""
    print(f"config error: {exc}", file=sys.stderr, flush=True)
    sys.exit(2)


def closest_spelling(word: str, valid: typing.Iterable[str]) -> str:
    """' (did you mean X?)' for the closest valid spelling of `word`, or '' when none is close."""
    matches = difflib.get_close_matches(word, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {matches[0]!r}?)" if matches else ""


RULE = "roll_rule"  # the metadata key of a field's Rule


@dataclass(frozen=True)
class Rule:
    """What a config field accepts beyond its type; `from_dict` checks every value it converts (None excepted).

    Bounds apply to numbers; `choices` and `pattern` (a full match, described by `expect`) to strings;
    `nonempty` to strings, lists and mappings; `items` to each list item or mapping value and `keys` to
    each mapping key; `parse` is a custom check that raises ConfigError. `hint` ends the message with
    the fix. A rule with an `anything` reason accepts every value of the type. A rule with a `deferred`
    reason is checked by the pipeline config's `validate()` (it needs other fields, the filesystem or the
    machine). `bad` is an invalid value for tests, where the bounds do not give one.
    """

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    choices: tuple[Any, ...] = ()
    pattern: str = ""
    expect: str = ""
    nonempty: bool = False
    items: Rule | None = None
    keys: Rule | None = None
    parse: Callable[[Any, str], Any] | None = None
    hint: str = ""
    anything: str = ""
    deferred: str = ""
    bad: Any = None

    def check(self, value: Any, path: str) -> None:
        """Raise a one-line ConfigError naming `path` unless `value` satisfies the rule."""
        if value is None or self.anything or self.deferred:
            return
        hint = f"; {self.hint}" if self.hint else ""
        if self.nonempty and not value:
            raise ConfigError(f"{path} is empty: give {self.expect or 'at least one value'}{hint}")
        if isinstance(value, int | float) and not self._in_bounds(value):
            raise ConfigError(f"{path}={value!r} is out of range: it must be {self._bounds_text()}{hint}")
        if self.choices and value not in self.choices:
            choices = ", ".join(map(repr, self.choices))
            raise ConfigError(
                f"{path}={value!r} is not one of {choices}{closest_spelling(str(value), map(str, self.choices))}"
            )
        if self.pattern and not re.fullmatch(self.pattern, value):
            raise ConfigError(f"{path}={value!r} is not {self.expect or f'a match of {self.pattern!r}'}{hint}")
        if self.parse is not None:
            self.parse(value, path)
        if self.items is not None:
            pairs = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in pairs:
                self.items.check(item, _join(path, str(key)) if isinstance(value, dict) else f"{path}[{key}]")
        if self.keys is not None:
            for key in value:
                self.keys.check(key, f"{path} key")

    def _in_bounds(self, value: float) -> bool:
        return (
            (self.gt is None or value > self.gt)
            and (self.ge is None or value >= self.ge)
            and (self.lt is None or value < self.lt)
            and (self.le is None or value <= self.le)
        )

    def _bounds_text(self) -> str:
        bounds = [(self.gt, ">"), (self.ge, ">="), (self.lt, "<"), (self.le, "<=")]
        return " and ".join(f"{op} {_number(bound)}" for bound, op in bounds if bound is not None)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def field_rule(f: dataclasses.Field) -> Rule | None:
    """The Rule a dataclass field declares, if any."""
    return f.metadata.get(RULE)


def check(rule: Rule | None = None, **constraints: Any) -> dict[str, Rule]:
    """Field metadata declaring `rule`, or `Rule(**constraints)`: `field(default=1e-5, metadata=check(gt=0))`."""
    return {RULE: rule or Rule(**constraints)}


def any_value(reason: str) -> dict[str, Rule]:
    """Field metadata declaring that any value of the field's type is valid, for `reason`."""
    return check(anything=reason)


def checked_in_validate(reason: str, bad: Any) -> dict[str, Rule]:
    """Field metadata: the pipeline config's `validate()` checks the field (`reason`); `bad` is a value it rejects."""
    return check(deferred=reason, bad=bad)


# Rules several schemas share.
SEED = Rule(ge=0, lt=2**32, hint="seeds are integers from 0 to 2**32 - 1 (NumPy's range)")
DOTTED_PATH = Rule(pattern=r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", expect="a dotted import path such as package.module.Name")


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
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        kwargs[name] = _convert(hints[name], value, _join(path, name))
        rule = field_rule(fields[name])
        if rule is not None:
            rule.check(kwargs[name], _join(path, name))
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
        others = [option for option in options if option is not type(None)]
        if len(others) == 1:  # `X | None`: X's own error names the nested field
            return _convert(others[0], value, path)
        errors = []
        for option in others:
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
