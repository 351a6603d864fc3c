"""RL role workers for failure tests; Ray workers import them by module path.

`ROLL_TEST_SLOW_SAVE_TAG` holds the rename that completes that checkpoint for 60 s, so a test can
kill the worker while the checkpoint is half written.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from unittest import mock

from roll.distributed.scheduler.decorator import Dispatch, register
from roll.pipeline.base.rl_workers import ActorWorker


class FailureTestActorWorker(ActorWorker):
    """roll's ActorWorker that can be made slow to finish one checkpoint."""

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, save_dir: str, tag: str) -> str:
        """Save as roll does; for the slow tag, wait before the staging directory is renamed into place."""
        if tag != os.environ.get("ROLL_TEST_SLOW_SAVE_TAG"):
            return super().save_checkpoint(save_dir, tag)
        rename = os.replace

        def slow_rename(source: str, target: str) -> None:
            if Path(source).name.endswith(".incomplete"):
                time.sleep(60)
            rename(source, target)

        with mock.patch("os.replace", slow_rename):
            return super().save_checkpoint(save_dir, tag)


class UnbuildableActorWorker(ActorWorker):
    """roll's ActorWorker whose model cannot be built: its initialize fails as a missing weight file would."""

    @register(Dispatch.ONE_TO_ALL)
    def initialize(self) -> None:
        """Fail."""
        raise OSError("no file named model.safetensors (a test worker that cannot build its model)")
