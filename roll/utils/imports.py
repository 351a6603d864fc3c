"""The one importer of user-named objects: worker classes, reward functions, anything given as a dotted path."""

from __future__ import annotations

import importlib
import traceback
from typing import Any


def exception_line(exc: BaseException) -> str:
    """The last line of `exc`'s traceback (`Type: message`), with the file and line it was raised at."""
    line = traceback.format_exception_only(exc)[-1].strip()
    frames = traceback.extract_tb(exc.__traceback__)
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{line} ({exc.filename}:{exc.lineno})"
    return f"{line} ({frames[-1].filename}:{frames[-1].lineno})" if frames else line


def import_object(dotted: str, field: str) -> Any:
    """The object a dotted path `package.module.name` names; ValueError naming `field` when it cannot be imported.

    A module that raises while it is imported (any exception: user code) is named with the exception's last line.
    """
    module_name, _, name = dotted.rpartition(".")
    if not module_name:
        raise ValueError(f"{field} {dotted!r} is not a dotted path like 'package.module.name'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any exception: the module is user code
        name_missing = isinstance(exc, ModuleNotFoundError) and f"{module_name}.".startswith(f"{exc.name}.")
        reason = str(exc) if name_missing else f"module {module_name!r} raised {exception_line(exc)}"
        raise ValueError(f"{field} {dotted!r} cannot be imported: {reason}") from exc
    try:
        return getattr(module, name)
    except AttributeError as exc:
        raise ValueError(f"{field} {dotted!r} cannot be imported: {exc}") from exc
