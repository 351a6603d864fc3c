"""The one importer of user-named objects: worker classes, reward functions, anything given as a dotted path."""

from __future__ import annotations

import importlib
from typing import Any


def import_object(dotted: str, field: str) -> Any:
    """The object a dotted path `package.module.name` names; ValueError naming `field` when it cannot be imported."""
    module_name, _, name = dotted.rpartition(".")
    if not module_name:
        raise ValueError(f"{field} {dotted!r} is not a dotted path like 'package.module.name'")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{field} {dotted!r} cannot be imported: {exc}") from exc
