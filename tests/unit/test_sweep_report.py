"""roll-sweep-report on sweep folders laid out as Hydra multiruns write them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from roll.utils.sweep_report import main, read_jobs, report, swept_keys


def write_job(sweep: Path, number: int, overrides: list[str], rows: list[dict]) -> None:
    job = sweep / str(number)
    (job / ".hydra").mkdir(parents=True)
    (job / "logs").mkdir()
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {item}\n" for item in overrides))
    (job / "logs" / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """lr x seed, 2 x 2 jobs; the loss falls and the accuracy rises and falls back."""
    for number, (lr, seed) in enumerate([("1e-3", 1), ("1e-3", 2), ("1e-2", 1), ("1e-2", 2)]):
        offset = 0.1 * seed + (0.2 if lr == "1e-2" else 0.0)
        rows = [
            {"step": 0, "val/accuracy": offset},
            {"step": 1, "actor/loss": 1.0 - offset},
            {"step": 2, "actor/loss": 0.5 - offset, "val/accuracy": offset + 0.4},
            {"step": 3, "actor/loss": 0.7 - offset, "val/accuracy": offset + 0.3},
        ]
        write_job(
            tmp_path, number, [f"seed={seed}", f"actor_train.training_args.learning_rate={lr}", "max_steps=3"], rows
        )
    return tmp_path


def test_jobs_are_named_by_what_differs_and_grouped_over_seeds(sweep: Path) -> None:
    jobs = read_jobs(sweep)
    assert swept_keys(jobs) == ["seed", "actor_train.training_args.learning_rate"]
    text = report(jobs, ["val/accuracy", "actor/loss"])
    assert "| 0 | 1 | 1e-3 | 0.4 | 0.5 | 0.6 | 0.4 |" in text  # final and best (highest accuracy, lowest loss)
    # Group lr=1e-2: finals 0.6 and 0.7 -> mean 0.65, sample standard deviation 0.071.
    assert "| actor_train.training_args.learning_rate=1e-2 | 2 | 0.65 ± 0.071 | 0.75 ± 0.071 |" in text


def test_the_command_writes_the_table_and_a_plot_per_metric(sweep: Path, capsys: pytest.CaptureFixture) -> None:
    main([str(sweep)])
    assert (sweep / "sweep_report.md").read_text().strip() == capsys.readouterr().out.split("\n\nwritten:")[0].strip()
    assert (sweep / "sweep_val_accuracy.png").stat().st_size > 0  # default: the held-out metrics only
    assert not (sweep / "sweep_actor_loss.png").exists()


def test_bad_folders_and_metrics_are_named(sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as empty:
        main([str(tmp_path / "nothing")])
    assert empty.value.code == 2 and "holds no job folders" in capsys.readouterr().err
    with pytest.raises(SystemExit) as unknown:
        main([str(sweep), "--metric", "val/acuracy"])
    assert unknown.value.code == 2 and "no job logged val/acuracy; logged: actor/loss, val/accuracy" in (
        capsys.readouterr().err
    )
