"""What a run prints and what its log files get (roll/utils/console.py): the console shows warnings, errors and
milestones; the detail goes to the run's log file; workers keep their libraries quiet; verbose brings it back."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers.utils import logging as transformers_logging

from roll.utils import console
from roll.utils.console import MILESTONE, VERBOSE_ENV, WORKER_LOG_ENV
from roll.utils.tracking import timed_evaluation


class Stderr:
    """What the code under test writes to sys.stderr (the console), through pytest's capture."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys, self.text = capsys, ""

    def getvalue(self) -> str:
        self.text += self.capsys.readouterr().err
        return self.text


@pytest.fixture
def stderr(capsys: pytest.CaptureFixture[str]) -> Stderr:
    return Stderr(capsys)


@pytest.fixture
def logging_restored() -> Iterator[None]:
    """The root logger, the library loggers (and their handlers' levels) and the worker setup put back."""
    root = logging.getLogger()
    names = (*console.LIBRARY_LOGGERS, "roll")
    saved = (list(root.handlers), root.level, {name: logging.getLogger(name).level for name in names})
    handler_levels = {h: h.level for name in names for h in logging.getLogger(name).handlers}
    yield
    for handler in console._worker_handlers:
        handler.close()
    console._worker_handlers.clear()
    root.handlers[:], level, levels = saved
    root.setLevel(level)
    for name, value in levels.items():
        logging.getLogger(name).setLevel(value)
    for handler, value in handler_levels.items():
        handler.setLevel(value)


def test_a_worker_keeps_its_libraries_quiet_and_writes_the_detail_to_a_file(
    tmp_path: Path, stderr: Stderr, logging_restored: None
) -> None:
    log_file = tmp_path / "logs" / "workers.log"
    console.configure_worker_logging({VERBOSE_ENV: "0", WORKER_LOG_ENV: str(log_file)})
    console.configure_worker_logging({VERBOSE_ENV: "1"})  # a second role in the same process: no second setup
    for name in ("DeepSpeed", "transformers", "accelerate", "torch.distributed", "ray"):
        assert logging.getLogger(name).getEffectiveLevel() == logging.WARNING, name
    logging.getLogger("torch.distributed.c10d").info("Added key: store_based_barrier_key:1 to store for rank: 0")
    logging.getLogger("roll.actor_train.rank0").info("step 1 sample 0: '1+2=' -> '3'")
    logging.getLogger("roll.actor_train.rank0").warning("reward_fn failed on response '3'")
    for handler in console._worker_handlers:
        handler.flush()
    assert stderr.getvalue() == "WARNING roll.actor_train.rank0: reward_fn failed on response '3'\n"
    written = log_file.read_text()
    assert "INFO pid" in written and "roll.actor_train.rank0: step 1 sample 0: '1+2=' -> '3'" in written
    assert "reward_fn failed" in written and "store_based_barrier_key" not in written


def test_a_process_not_started_as_a_worker_keeps_its_logging(logging_restored: None) -> None:
    handlers = list(logging.getLogger().handlers)
    console.configure_worker_logging({})  # a test building a worker in its own process
    assert logging.getLogger().handlers == handlers and not console._worker_handlers


def test_a_verbose_worker_shows_the_detail_and_the_libraries_info(stderr: Stderr, logging_restored: None) -> None:
    console.configure_worker_logging({VERBOSE_ENV: "1"})
    assert logging.getLogger("DeepSpeed").getEffectiveLevel() == logging.INFO
    logging.getLogger("roll.reference.rank1").info("loaded the model")
    assert "roll.reference.rank1: loaded the model" in stderr.getvalue()


def test_the_driver_console_shows_milestones_and_warnings_and_the_run_log_gets_everything(
    tmp_path: Path, stderr: Stderr, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(WORKER_LOG_ENV, raising=False)
    root = logging.getLogger()
    handlers_before, bars_before = list(root.handlers), transformers_logging.is_progress_bar_enabled()
    transformers_logging.enable_progress_bar()  # as a driver starts (the test process may have them off)
    log = logging.getLogger("roll.test_console")
    path = tmp_path / "run" / "logs" / "run.log"
    with console.run_logging(verbose=False) as logs:
        log.info("rewards.math.model_args.dtype=auto -> fp32 on this machine")  # before the file is known
        logging.getLogger("ray").info("Started a local Ray instance.")
        assert logs.to_file(path, "examples/start_rlvr_pipeline.py max_steps=2") == path
        assert os.environ[WORKER_LOG_ENV] == str(path.parent / "workers.log")
        assert os.environ[VERBOSE_ENV] == "0"
        assert not transformers_logging.is_progress_bar_enabled()  # weights the driver writes (tiny://): no bars
        log.info("step 1 sample 0: '1+2=' -> '3'")
        log.info("checkpoint step_2 saved in out/checkpoints/step_2", extra=MILESTONE)
        log.warning("data.train_file: dropped 2 of 4 rows")
        _warn_token_auth_enabled()  # Ray's note on its own default: detail
    assert stderr.getvalue() == (
        "checkpoint step_2 saved in out/checkpoints/step_2\n"
        "WARNING roll.test_console: data.train_file: dropped 2 of 4 rows\n"
    )
    written = path.read_text()
    assert written.startswith("==== ") and "examples/start_rlvr_pipeline.py max_steps=2\n" in written
    for line in (
        "dtype=auto -> fp32",
        "Started a local Ray instance.",
        "step 1 sample 0",
        "checkpoint step_2",
        "dropped",
    ):
        assert line in written, line
    assert root.handlers == handlers_before and WORKER_LOG_ENV not in os.environ and VERBOSE_ENV not in os.environ
    bars_after = transformers_logging.is_progress_bar_enabled()
    if not bars_before:
        transformers_logging.disable_progress_bar()
    assert bars_after


def _warn_token_auth_enabled() -> None:
    """Logs as Ray 2.60 does when a new local cluster turns token authentication on by default."""
    logging.getLogger("ray._private.authentication.authentication_token_setup").warning(
        "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out."
    )


def test_a_verbose_driver_shows_the_detail_and_debug_of_the_loggers_hydra_names(tmp_path: Path, stderr: Stderr) -> None:
    log = logging.getLogger("roll.test_console")
    with console.run_logging(verbose=True, debug_loggers=["roll"]) as logs:
        logs.to_file(tmp_path / "run.log", "cmd")
        assert os.environ[VERBOSE_ENV] == "1" and console.worker_env()[VERBOSE_ENV] == "1"
        log.info("step 1 sample 0")
        log.debug("a debug record")
    assert "step 1 sample 0" in stderr.getvalue() and "a debug record" in stderr.getvalue()
    assert logging.getLogger("roll").level == logging.NOTSET


def test_workers_start_with_their_libraries_quiet_unless_verbose() -> None:
    quiet = console.worker_env({WORKER_LOG_ENV: "/out/logs/workers.log"})
    assert quiet == {
        VERBOSE_ENV: "0",
        "TRANSFORMERS_VERBOSITY": "warning",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        WORKER_LOG_ENV: "/out/logs/workers.log",
    }
    verbose = console.worker_env({VERBOSE_ENV: "1"})
    assert verbose == {VERBOSE_ENV: "1", "TRANSFORMERS_VERBOSITY": "info"}


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["-v", "max_steps=2"], ["max_steps=2", "hydra.verbose=roll"]),
        (["--verbose"], ["hydra.verbose=roll"]),
        (["-v", "hydra.verbose=true"], ["hydra.verbose=true"]),
        (["-m", "seed=1,2"], ["-m", "seed=1,2"]),
    ],
)
def test_dash_v_is_a_hydra_verbose_override(argv: list[str], expected: list[str]) -> None:
    assert console.verbose_args(argv) == expected


def test_hydra_verbose_names_the_loggers_at_debug() -> None:
    assert console.debug_loggers(False) == [] and console.debug_loggers(None) == []
    assert console.debug_loggers(True) == [""]
    assert console.debug_loggers("roll") == ["roll"]
    assert console.debug_loggers(["roll", "DeepSpeed"]) == ["roll", "DeepSpeed"]


def test_what_a_library_prints_becomes_a_record_for_the_log_file(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="roll.test_console"), console.prints_to_log("roll.test_console"):
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
    assert capsys.readouterr().out == ""
    assert [r.getMessage() for r in caplog.records] == [
        "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully"
    ]


def test_ray_workers_start_quiet_with_deepspeed_told_its_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from roll.distributed.scheduler import initialize

    started: dict = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: started.update(kwargs))
    for name in ("DS_ACCELERATOR", "RAY_ADDRESS", VERBOSE_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(WORKER_LOG_ENV, "/out/rlvr/logs/workers.log")
    initialize.init_ray(None, "roll", 2, "cpu")
    env = started["runtime_env"]["env_vars"]
    assert env["DS_ACCELERATOR"] == "cpu" and os.environ["DS_ACCELERATOR"] == "cpu"  # the driver imports it too
    assert env["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and env["TRANSFORMERS_VERBOSITY"] == "warning"
    assert env[WORKER_LOG_ENV] == "/out/rlvr/logs/workers.log" and env[VERBOSE_ENV] == "0"


def test_an_evaluation_is_a_console_milestone_naming_its_step_and_results(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="roll.utils.tracking"):
        metrics = timed_evaluation(lambda: {"val/accuracy": 0.4375, "val/response_length": 3.0}, 20)
    assert metrics["val/accuracy"] == 0.4375 and metrics["time/eval_s"] >= 0
    [record] = caplog.records
    assert record.getMessage() == "evaluation at step 20: accuracy 0.438, response_length 3"
    assert getattr(record, "milestone", False)
