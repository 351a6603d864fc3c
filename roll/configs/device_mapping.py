"""Parsing of a role's `device_mapping`: which global device indices its workers occupy."""

from __future__ import annotations

import re

from roll.configs.schema import ConfigError

_RANGE_CALL = re.compile(r"^\s*(?:list\()?\s*range\(\s*(\d+)\s*(?:,\s*(\d+)\s*)?\)\s*\)?\s*$")
_SPAN = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


ALL_DEVICES = "all"


def parse_device_mapping(value: str | int | list[int], field: str, total_devices: int | None = None) -> list[int]:
    """Global device indices from a list, an int, `"0-3"`, `"0,2,4-7"`, `"list(range(0, 4))"`, or `"all"`: every
    device of a cluster of `total_devices` (none while the cluster's size is not known yet), so that a recipe whose
    roles share all devices follows num_nodes and devices_per_node.

    The string forms are parsed, never evaluated. Indices must be unique and non-negative.
    """
    if value == ALL_DEVICES:
        return [] if total_devices is None else list(range(total_devices))
    if isinstance(value, bool):
        raise ConfigError(f"{field}: expected device indices, got {value!r}")
    if isinstance(value, int):
        devices = [value]
    elif isinstance(value, list):
        devices = list(value)
    else:
        devices = _parse_string(value, field)
    if not devices:
        raise ConfigError(f"{field} is empty: give at least one device, e.g. {field}=0-1")
    if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in devices):
        raise ConfigError(f"{field}: device indices must be non-negative integers, got {value!r}")
    duplicates = sorted({d for d in devices if devices.count(d) > 1})
    if duplicates:
        raise ConfigError(f"{field} lists device(s) {duplicates} more than once")
    return devices


def _parse_string(text: str, field: str) -> list[int]:
    text = text.strip().strip("[]")
    call = _RANGE_CALL.match(text)
    if call:
        start, stop = (0, int(call[1])) if call[2] is None else (int(call[1]), int(call[2]))
        return list(range(start, stop))
    devices: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        span = _SPAN.match(part)
        if not span:
            raise ConfigError(
                f"{field}: cannot parse {part!r} in {text!r}; use a list like [0, 1], "
                "a range like '0-3' or a mix like '0,2,4-7'"
            )
        first, last = int(span[1]), int(span[2] if span[2] is not None else span[1])
        if last < first:
            raise ConfigError(f"{field}: range {part!r} runs backwards; write it as '{last}-{first}'")
        devices.extend(range(first, last + 1))
    return devices
