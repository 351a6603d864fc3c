"""What a pipeline config with `resume_from_checkpoint`, `run_dir` and an export directory derives from them."""

from __future__ import annotations

from pathlib import Path

from roll.configs.schema import ConfigError
from roll.pipeline.base.checkpoint_state import latest_complete_tag, load_driver_state

AUTO = "auto"  # resume_from_checkpoint: the latest complete checkpoint if there is one, else start afresh


class ResumableRun:
    """Mixin of a pipeline config: where its checkpoints and export go, and the check of the one to resume."""

    run_dir: str
    resume_from_checkpoint: str
    export_dir: str

    @property
    def checkpoint_root(self) -> Path:
        """Where checkpoints are written (valid after `validate`)."""
        return Path(self.run_dir) / "checkpoints"

    @property
    def resume_root(self) -> Path:
        """The checkpoints folder to resume from: this run's for a bare tag (`step_2`, `latest`), else the folder
        of the checkpoint directory `resume_from_checkpoint` gives as a path, exactly as given."""
        requested = Path(self.resume_from_checkpoint).expanduser()
        return self.checkpoint_root if requested.parent == Path(".") else requested.parent

    @property
    def resume_tag(self) -> str | None:
        """The checkpoint tag `resume_from_checkpoint` names in `resume_root` (None: the latest complete one)."""
        name = Path(self.resume_from_checkpoint).name
        return None if name == "latest" else name

    @property
    def model_export_dir(self) -> str:
        """The export directory, defaulted under the run directory."""
        return self.export_dir or f"{self.run_dir}/model"

    def check_resume(self) -> None:
        """A `resume_from_checkpoint` names a complete checkpoint, else a ConfigError; `auto` becomes `latest` when
        this run's checkpoints hold a complete one and empty (start afresh) when not, for a job that a scheduler
        starts again with the same command (a requeued SLURM job, a retried RayJob)."""
        if self.resume_from_checkpoint == AUTO:
            try:
                latest_complete_tag(self.checkpoint_root)
                self.resume_from_checkpoint = "latest"
            except FileNotFoundError:
                self.resume_from_checkpoint = ""
        if not self.resume_from_checkpoint:
            return
        root, tag = self.resume_root, self.resume_tag
        try:
            load_driver_state(root, tag)
        except FileNotFoundError as exc:
            where = f"in {root}" if tag is None else f"at {root / tag}"
            raise ConfigError(
                f"resume_from_checkpoint={self.resume_from_checkpoint!r}: no complete checkpoint {where}; name a "
                "saved step (e.g. step_2, or a checkpoint directory's path) or leave it empty to start afresh"
            ) from exc
