"""A checkpoint directory that appears only when every rank has written it, and each rank's RNG states.

Layout of `save_dir`, whatever the backend writes inside a checkpoint:

    latest                      the tag of the newest complete checkpoint (replaced atomically)
    <tag>/roll_checkpoint.json  written last: a directory without it is never loaded
    <tag>/rng_rank<r>.pt        each rank's Python, NumPy and torch RNG states

A save goes to `.<tag>.incomplete` first and is renamed once every rank has written; a crash mid-save leaves only
that hidden directory, which is ignored and replaced by the next save. Ranks must share the filesystem of
`save_dir`, and every rank of torch's default process group takes part.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from roll.utils.fileio import read_latest_tag, write_text_atomically

MARKER = "roll_checkpoint.json"
LATEST = "latest"


@contextmanager
def staged_checkpoint(save_dir: str, tag: str, meta: dict[str, Any]) -> Iterator[Path]:
    """Yield the staging directory every rank writes `save_dir/tag` into; on leaving, with each rank's RNG states
    saved beside, rank 0 writes the marker (`meta`, the tag and the time), renames it into place and points
    `latest` at it. Every rank leaves once it is complete."""
    rank = dist.get_rank()
    root = Path(save_dir)
    final, staging = root / tag, root / f".{tag}.incomplete"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    yield staging
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(rng, staging / f"rng_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        (staging / MARKER).write_text(json.dumps({"tag": tag, **meta, "time": time.time()}))
        if final.exists():
            retired = root / f".{tag}.retired"
            os.replace(final, retired)
            shutil.rmtree(retired)
        os.replace(staging, final)
        write_text_atomically(root / LATEST, tag)
    dist.barrier()


def resolve_checkpoint(load_dir: str, tag: str | None) -> Path:
    """The directory of checkpoint `tag` (or of the latest complete one); FileNotFoundError if incomplete."""
    root = Path(load_dir)
    if tag is None:
        tag = read_latest_tag(root, LATEST)
    path = root / tag
    if not (path / MARKER).is_file():
        raise FileNotFoundError(f"{path} is not a complete roll checkpoint (no {MARKER}); pick another tag")
    return path


def checkpoint_meta(path: Path) -> dict[str, Any]:
    """What the checkpoint's marker records (sizes, stage, backend)."""
    return json.loads((path / MARKER).read_text())


def check_checkpoint_backend(path: Path, backend: str) -> None:
    """ValueError unless checkpoint `path` was written by training backend `backend` (one without a record was
    written by deepspeed_train); the message says how to move a run to another backend."""
    written_by = checkpoint_meta(path).get("backend", "deepspeed_train")
    if written_by != backend:
        raise ValueError(
            f"{path} was written by {written_by}, and {backend} resumes only its own checkpoints; resume with "
            f"{written_by}, or start a new run on {backend} from the old run's export (pretrain=<its run dir>/model: "
            "the weights carry over, the optimizer state and the step count do not)"
        )


def restore_rng(path: Path, rank: int) -> None:
    """Restore this rank's RNG states from checkpoint `path` (a rank the checkpoint had no states for keeps its own)."""
    rng_file = path / f"rng_rank{rank}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
