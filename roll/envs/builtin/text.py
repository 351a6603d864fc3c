"""Reading an action's text."""

from __future__ import annotations

import re

_INTEGER = re.compile(r"\d+")


def last_integer(text: str, max_digits: int = 30) -> int | None:
    """The last run of digits in `text` as an int; None when there is none or it has more than `max_digits`."""
    found = _INTEGER.findall(text)
    return int(found[-1]) if found and len(found[-1]) <= max_digits else None
