"""benchmarks/suite_cpu.py: the machine's CPU counter, and the table it writes into docs/testing.md."""

from __future__ import annotations

import os

from benchmarks.suite_cpu import FileRun, machine_cpu_s, table


def test_the_machine_cpu_counter_grows_with_work() -> None:
    before = machine_cpu_s()
    spent = os.times()
    while os.times().user - spent.user < 0.2:  # busy for 0.2 s of this process's CPU time
        pass
    assert machine_cpu_s() - before >= 0.15


def test_the_table_puts_the_most_cpu_first_and_sums_every_run() -> None:
    runs = [
        FileRun("tests/integration/test_a.py", 0, 3, wall_s=10.0, cpu_s=12.0),
        FileRun("tests/integration/test_b.py", 1, 1, wall_s=30.0, cpu_s=50.0),
        FileRun("tests/unit", 0, 100, wall_s=20.0, cpu_s=18.0),
    ]
    lines = table(runs).splitlines()
    rows = [line for line in lines if line.startswith("| tests/")]
    assert rows == [
        "| tests/integration/test_b.py (exit 1) | 1 | 30 | 50 |",
        "| tests/unit | 100 | 20 | 18 |",
        "| tests/integration/test_a.py | 3 | 10 | 12 |",
    ]
    assert "| **all, one at a time** | 104 | 60 | 80 |" in lines
    cores = len(os.sched_getaffinity(0))
    assert lines[-1] == f"Summed CPU time / {cores} cores: **{80 / cores:.0f} s**, less each path's own start-up."
