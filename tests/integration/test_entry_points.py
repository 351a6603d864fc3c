"""The entry scripts as a user runs them: in a process of their own, or for config errors (which end before any
work) in the test process through the same entry functions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.in_process import run_in_process
from tests.pipeline_runs import config_error_of, logged_metrics

SFT = "examples/start_sft_pipeline.py"


def test_a_dry_run_starts_no_ray() -> None:
    """The shared entry code validates and prints the plan only (the README test dry-runs the other pipelines)."""
    result = subprocess.run(
        [sys.executable, "examples/start_cluster_check.py", "dry_run=true"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "nothing was started" in result.stdout and "== placement" in result.stdout
    assert "Started a local Ray instance" not in result.stderr


def test_a_user_yaml_that_does_not_parse_is_a_config_error_naming_its_line(tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text("defaults:\n  - sft_arithmetic\n  - _self_\n\nmax_steps: [1\nseed: 2\n")
    args = ["--config-dir", str(tmp_path), "--config-name", "mine", f"output_dir={tmp_path}"]
    message = config_error_of(SFT, *args, own_process=True)  # the one config error a real process ends with
    assert message.startswith(f"{tmp_path / 'mine.yaml'} line 6, column 5 does not parse as YAML: "), message


def test_an_output_dir_that_cannot_be_written_is_a_config_error_before_hydra_writes(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for args in (["seed=1"], ["-m", "seed=1,2"]):  # Hydra writes a single run's files and a sweep's elsewhere
        message = config_error_of(SFT, *args, f"output_dir={blocker}/out")
        assert message == (
            f"output_dir='{blocker}/out' cannot be written: {blocker} is a file, not a directory; point output_dir "
            "at a writable directory"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
    writable, unwritable = tmp_path / "out", f"{blocker}/hydra"
    message = config_error_of(SFT, f"output_dir={writable}", f"hydra.run.dir={unwritable}")
    assert message.startswith(f"hydra.run.dir='{unwritable}' cannot be written: "), message
    assert not writable.exists()


@pytest.mark.slow
def test_each_job_of_a_sweep_keeps_its_own_outputs(tmp_path) -> None:
    """`roll-sft -m seed=1,2`: two jobs, each with its metrics, export and Hydra files, all under output_dir."""
    one_rank = ["devices_per_node=1", "actor_train.device_mapping=0", "batch_size=32"]  # half the worker start-ups
    command = ["roll-sft", "-m", "seed=1,2", "max_steps=1", "eval_steps=1", *one_rank, f"output_dir={tmp_path / 'out'}"]
    result = subprocess.run(
        command,
        cwd=tmp_path,
        env=os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (sweep,) = (tmp_path / "out" / "sft").glob("sweep-*")
    jobs = sorted(path for path in sweep.iterdir() if path.is_dir())
    assert [job.name for job in jobs] == ["0", "1"]
    for job, seed in zip(jobs, ("seed=1", "seed=2"), strict=True):
        assert seed in (job / ".hydra" / "overrides.yaml").read_text()
        metrics = logged_metrics(job)
        assert any("val/accuracy" in row for row in metrics)
        assert (job / "model" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "nothing may land in the working directory"
    # The sweep's comparison, from the run's folder (its latest sweep): one row per job, then the seeds' mean
    # and spread, and a plot per metric. Run in this process through its console script's function, which saves
    # a Python start; roll-sft above is the console-script route in a process of its own.
    compared = run_in_process(["roll-sweep-report", str(sweep.parent)], tmp_path)
    assert compared.returncode == 0, compared.stderr[-3000:]
    table = (sweep / "sweep_report.md").read_text()
    accuracies = [[row["val/accuracy"] for row in logged_metrics(job) if "val/accuracy" in row] for job in jobs]
    assert f"| 0 | 1 | {accuracies[0][-1]:.4g} | {max(accuracies[0]):.4g} |" in table
    assert f"| 1 | 2 | {accuracies[1][-1]:.4g} | {max(accuracies[1]):.4g} |" in table
    assert "| all | 2 | " in table and (sweep / "sweep_val_accuracy.png").is_file()
