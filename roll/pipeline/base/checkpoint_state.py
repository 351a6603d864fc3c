"""The driver's part of a pipeline checkpoint: step, data position and controller state, as JSON.

Layout of a run's checkpoint root:

    <role>/<tag>/...            each trained role's checkpoint (roll/utils/staged_checkpoint.py), written first
    <tag>/driver_state.json     written once every role's is complete; it names the roles (`roles`)
    latest                      the tag last written, replaced atomically

A checkpoint is complete when its driver state exists and so does every role checkpoint it names. A crash
mid-save therefore never becomes the checkpoint a resume picks: `latest` moves only after the driver state is
written, and when it names a checkpoint that is not complete (a later crash while a tag was written again, or a
removal half done), the newest complete one is picked instead. `keep_last_n` removes older checkpoints only after
`latest` names the new one, driver state first, so a removal cut short leaves an incomplete directory, never a
checkpoint that looks complete without its roles.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

from roll.utils.console import MILESTONE
from roll.utils.fileio import read_latest_tag, write_text_atomically
from roll.utils.staged_checkpoint import MARKER

logger = logging.getLogger(__name__)

STATE_FILE = "driver_state.json"
LATEST = "latest"
ROLES = "roles"  # the driver state's list of the roles whose checkpoints belong to it
_STEP_TAG = re.compile(r"step_(\d+)")


def save_driver_state(root: Path, tag: str, state: dict[str, Any], keep_last_n: int = 0) -> str:
    """Write `root/tag/driver_state.json`, make `tag` the latest checkpoint, then keep only the `keep_last_n` newest
    complete checkpoints (0 keeps all); return the directory."""
    directory = root / tag
    directory.mkdir(parents=True, exist_ok=True)
    write_text_atomically(directory / STATE_FILE, json.dumps(state))
    write_text_atomically(root / LATEST, tag)
    logger.info("checkpoint %s saved in %s", tag, directory, extra=MILESTONE)
    if keep_last_n:
        remove_old_checkpoints(root, keep_last_n)
    return str(directory)


def is_complete(root: Path, tag: str) -> bool:
    """Whether checkpoint `tag` in `root` has its driver state and every role checkpoint that state names."""
    state_file = root / tag / STATE_FILE
    if not state_file.is_file():
        return False
    try:
        roles = json.loads(state_file.read_text()).get(ROLES, [])
    except json.JSONDecodeError:
        return False
    return all((root / role / tag / MARKER).is_file() for role in roles)


def step_tags(root: Path) -> list[str]:
    """The `step_<n>` directories of driver states in `root`, oldest step first."""
    if not root.is_dir():
        return []
    tags = [path.name for path in root.iterdir() if path.is_dir() and _STEP_TAG.fullmatch(path.name)]
    return sorted(tags, key=_step)


def latest_complete_tag(root: Path) -> str:
    """The tag `latest` names if that checkpoint is complete, else the newest complete one; FileNotFoundError if
    `root` holds none."""
    try:
        named = read_latest_tag(root, LATEST)
    except FileNotFoundError:
        named = None
    if named is not None and is_complete(root, named):
        return named
    complete = [tag for tag in step_tags(root) if is_complete(root, tag)]
    if not complete:
        raise FileNotFoundError(f"resume_from_checkpoint=latest but {root} holds no complete checkpoint")
    logger.warning("%s names %s, not complete; taking %s, the newest complete one", LATEST, named, complete[-1])
    return complete[-1]


def remove_old_checkpoints(root: Path, keep_last_n: int) -> list[str]:
    """Remove every checkpoint older than the `keep_last_n` newest complete ones (incomplete leftovers among them,
    the roles' too); `latest` and the checkpoint it picks are always kept. Return the removed tags."""
    latest = latest_complete_tag(root)
    kept = [tag for tag in step_tags(root) if is_complete(root, tag)][-keep_last_n:]
    oldest_kept = min(_step(tag) for tag in [*kept, latest])
    roles = json.loads((root / latest / STATE_FILE).read_text()).get(ROLES, [])
    folders = [root, *(root / role for role in roles)]
    removed = sorted({tag for folder in folders for tag in step_tags(folder) if _step(tag) < oldest_kept}, key=_step)
    for tag in removed:
        (root / tag / STATE_FILE).unlink(missing_ok=True)  # first: from here on the checkpoint is incomplete
        for role in roles:
            shutil.rmtree(root / role / tag, ignore_errors=True)
        shutil.rmtree(root / tag, ignore_errors=True)
    if removed:
        logger.info("keep_last_n=%d: removed checkpoints %s", keep_last_n, ", ".join(removed))
    return removed


def _step(tag: str) -> int:
    return int(tag.removeprefix("step_"))


def load_driver_state(root: Path, tag: str | None) -> dict[str, Any]:
    """The driver state of checkpoint `tag` (the latest complete one when None); FileNotFoundError if absent or
    incomplete."""
    if tag is None:
        tag = latest_complete_tag(root)
    if not is_complete(root, tag):
        raise FileNotFoundError(f"{root / tag} is not a complete checkpoint (no {STATE_FILE}, or a role's is missing)")
    return json.loads((root / tag / STATE_FILE).read_text())
