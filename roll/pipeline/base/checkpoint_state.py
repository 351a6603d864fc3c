"""The driver's part of a pipeline checkpoint: step, data position and controller state, as JSON.

Written after every role has saved its own checkpoint under the same tag, and pointed to by
`latest` only once complete, so a crash mid-save never becomes the checkpoint a resume picks.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from roll.utils.console import MILESTONE
from roll.utils.fileio import read_latest_tag, write_text_atomically

logger = logging.getLogger(__name__)

STATE_FILE = "driver_state.json"
LATEST = "latest"


def save_driver_state(root: Path, tag: str, state: dict[str, Any]) -> str:
    """Write `root/tag/driver_state.json` and make `tag` the latest checkpoint; return the directory."""
    directory = root / tag
    directory.mkdir(parents=True, exist_ok=True)
    write_text_atomically(directory / STATE_FILE, json.dumps(state))
    write_text_atomically(root / LATEST, tag)
    logger.info("checkpoint %s saved in %s", tag, directory, extra=MILESTONE)
    return str(directory)


def load_driver_state(root: Path, tag: str | None) -> dict[str, Any]:
    """The driver state of checkpoint `tag` (the latest complete one when None); FileNotFoundError if absent."""
    if tag is None:
        try:
            tag = read_latest_tag(root, LATEST)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"resume_from_checkpoint=latest but {root} holds no complete checkpoint") from exc
    state_file = root / tag / STATE_FILE
    if not state_file.is_file():
        raise FileNotFoundError(f"{root / tag} is not a complete checkpoint (no {STATE_FILE})")
    return json.loads(state_file.read_text())
