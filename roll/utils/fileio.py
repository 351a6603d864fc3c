"""Small file helpers that never leave a half-written file behind."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` in one step: readers see the old content or the new, never a part."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
