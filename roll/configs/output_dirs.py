"""The directories a run writes to are checked before anything is written there: by Hydra (its `.hydra` files, at
job start) or by the run (logs, checkpoints, exports)."""

from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from roll.configs.schema import ConfigError, exit_on_config_error
from roll.utils.fileio import unwritable_reason


def check_writable(setting: str, path: str) -> None:
    """Directory `path` (the value of `setting`) can be created and written to, else a ConfigError naming both."""
    reason = unwritable_reason(path)
    if reason is not None:
        raise ConfigError(f"{setting}={path!r} cannot be written: {reason}; point {setting} at a writable directory")


class WritableOutput(Callback):
    """Hydra callback: `output_dir` and the folder Hydra writes its files to can be written, checked before Hydra
    writes there (a config error, exit code 2, otherwise)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        """A single run: Hydra writes to `hydra.run.dir`."""
        _check(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """A sweep: Hydra writes to `hydra.sweep.dir`."""
        _check(config, "hydra.sweep.dir")


def _check(config: DictConfig, hydra_dir: str) -> None:
    for setting in ("output_dir", hydra_dir):
        try:
            path = OmegaConf.select(config, setting, throw_on_missing=True)
            if isinstance(path, str) and path:
                check_writable(setting, path)
        except OmegaConfBaseException:
            continue  # an unresolvable value is the config loader's to report
        except ConfigError as exc:
            exit_on_config_error(exc)
