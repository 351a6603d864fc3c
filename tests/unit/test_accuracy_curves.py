"""Time-to-accuracy arithmetic of benchmarks/compare_trl.py --to-accuracy (benchmarks/accuracy_curves.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.accuracy_curves import (
    Point,
    final_accuracy,
    first_reaching,
    load_points,
    mean_curve,
    roll_points,
    save_points,
    standard_error,
    trailing_means,
)


def test_roll_points_leave_every_evaluation_out_of_wall_and_training_time() -> None:
    rows = [
        {"step": 0, "val/accuracy": 0.25, "time/eval_s": 2.0, "time/elapsed_s": 30.0},
        {"step": 1, "time/step_s": 1.0},
        {"step": 2, "time/step_s": 4.0, "val/accuracy": 0.5, "time/eval_s": 2.5, "time/elapsed_s": 37.0},
    ]
    assert roll_points(rows) == [Point(0, 0.25, 28.0, 0.0), Point(2, 0.5, 32.5, 2.5)]


def test_the_target_is_reached_where_the_seeds_smoothed_mean_first_gets_there() -> None:
    a = [Point(0, 0.2, 10, 0), Point(10, 0.6, 20, 5), Point(20, 0.4, 30, 10), Point(30, 0.8, 40, 15)]
    b = [Point(0, 0.2, 12, 0), Point(10, 0.2, 22, 7), Point(20, 0.6, 32, 14), Point(30, 0.8, 42, 21)]
    mean = mean_curve([a, b])
    assert [p.accuracy for p in mean] == pytest.approx([0.2, 0.4, 0.5, 0.8])
    assert mean[1].wall_s == 21 and mean[1].train_s == 6
    assert trailing_means([0.2, 0.4, 0.5, 0.8], 3) == pytest.approx([0.2, 0.3, 0 + 1.1 / 3, 1.7 / 3])
    reached = first_reaching([a, b], target=0.55, window=3)
    assert reached is not None and reached.step == 30 and reached.wall_s == 41
    assert first_reaching([a, b], target=0.9, window=3) is None
    assert first_reaching([a, b], target=0.4, window=1).step == 10  # type: ignore[union-attr]
    assert final_accuracy(a, 2) == pytest.approx(0.6)


def test_points_round_trip_through_the_child_process_file_and_the_error_is_binomial(tmp_path: Path) -> None:
    points = [Point(0, 0.5, 1.5, 0.0), Point(10, 0.75, 9.0, 6.0)]
    save_points(points, tmp_path / "p.json")
    assert load_points(tmp_path / "p.json") == points
    assert standard_error(0.5, 625) == pytest.approx(0.02)
