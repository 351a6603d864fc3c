"""benchmarks/doc_tables.py and every benchmark's --write-docs: marked blocks, the machine line, the blocks in docs/."""

from __future__ import annotations

import datetime
import importlib
from pathlib import Path

import pytest
import torch

from benchmarks import doc_tables
from roll.platforms import get_platform
from roll.platforms.cpu import cpu_model_name

BENCHMARKS = sorted(
    p.stem
    for p in (doc_tables.REPO_ROOT / "benchmarks").glob("*.py")
    if p.stem not in ("__init__", "doc_tables", "accuracy_curves")  # helpers, not benchmarks
)


def _doc(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "doc.md"
    path.write_bytes(text.encode())
    return path


def test_replace_block_changes_only_the_text_between_the_markers(tmp_path: Path) -> None:
    begin, end = doc_tables.markers("x")
    head = "# Title\r\n\nkeep  trailing spaces  \n<!-- bench:y -->\nother block\n<!-- /bench:y -->\n\n"
    tail = "\n\nafter, no final newline"
    path = _doc(tmp_path, f"{head}{begin}\nold\n| a |\n{end}{tail}")
    doc_tables.replace_block(path, "x", "new line\n| b |\n")
    assert path.read_bytes().decode() == f"{head}{begin}\nnew line\n| b |\n{end}{tail}"
    assert doc_tables.read_block(path, "x") == "new line\n| b |"
    assert doc_tables.read_block(path, "y") == "other block"
    doc_tables.replace_block(path, "x", "again")  # idempotent shape: one newline each side
    assert path.read_bytes().decode() == f"{head}{begin}\nagain\n{end}{tail}"


def test_write_block_starts_with_the_command_and_the_machine(tmp_path: Path) -> None:
    begin, end = doc_tables.markers("x")
    path = _doc(tmp_path, f"a\n{begin}\n{end}\nb\n")
    doc_tables.write_block(path, "x", "python benchmarks/x.py --n 1", "| t |")
    body = doc_tables.read_block(path, "x").splitlines()
    assert body[0].startswith("Measured with `python benchmarks/x.py --n 1` on " + cpu_model_name())
    assert body[1:] == ["", "| t |"]
    assert path.read_text().startswith(f"a\n{begin}\n") and path.read_text().endswith(f"\n{end}\nb\n")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("no markers at all\n", "'<!-- bench:x -->' is missing"),
        ("<!-- bench:x -->\nbody\n", "'<!-- /bench:x -->' is missing"),
        ("<!-- /bench:x -->\n<!-- bench:x -->\n", "comes before"),
        ("<!-- bench:x -->\n<!-- bench:x -->\n<!-- /bench:x -->\n", "there 2 times"),
    ],
)
def test_a_missing_or_broken_marker_names_the_file_and_the_marker(tmp_path: Path, text: str, message: str) -> None:
    path = _doc(tmp_path, text)
    with pytest.raises(doc_tables.MarkerError, match=message) as error:
        doc_tables.replace_block(path, "x", "new")
    assert str(path) in str(error.value)
    assert path.read_text() == text  # nothing written


def test_a_missing_doc_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(doc_tables.MarkerError, match=r"no such file.*<!-- bench:x -->"):
        doc_tables.replace_block(tmp_path / "absent.md", "x", "new")


def test_upsert_rows_replaces_by_key_and_appends_new_keys() -> None:
    body = "| k | v |\n|---|---|\n| a | 1 |\n| b | 2 |"
    assert doc_tables.upsert_rows(body, [("| a |", "| a | 9 |"), ("| c |", "| c | 3 |")]) == (
        "| k | v |\n|---|---|\n| a | 9 |\n| b | 2 |\n| c | 3 |"
    )


def test_machine_line_names_cpu_cores_memory_load_versions_and_date(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doc_tables, "LOAD_AT_START", 1.234)
    line = doc_tables.machine(("torch", "no-such-package"), today=datetime.date(2026, 1, 2))
    assert line.startswith(cpu_model_name() + ", ")
    assert f"{get_platform('cpu').device_count()} " in line and " cores, " in line and " GiB memory, " in line
    assert ", load average 1.23 at the start; " in line
    assert f"torch {torch.__version__}" in line and "no-such-package not installed" in line
    assert line.endswith("; 2026-01-02")


def test_command_line_drops_write_docs_and_names_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    monkeypatch.delenv("UNSET_FOR_TEST", raising=False)
    command = doc_tables.command_line(
        "/x/benchmarks/b.py", ["--write-docs", "--n", "2", "a=${b}"], env=("THP_MEM_ALLOC_ENABLE", "UNSET_FOR_TEST")
    )
    assert command == "THP_MEM_ALLOC_ENABLE=0 python benchmarks/b.py --n 2 'a=${b}'"


def test_rlvr_phase_names_are_every_phase_phases_py_declares() -> None:
    from roll.pipeline.base.residency import Phase
    from roll.pipeline.rlvr import phases

    declared = [v.name for v in vars(phases).values() if isinstance(v, Phase)]
    assert list(doc_tables.rlvr_phase_names()) == declared, "add the new phase to phases.STEP_PHASES"
    assert "reference_and_old_log_probs" in declared


def test_step_breakdown_table_shows_every_logged_phase_in_run_order() -> None:
    from benchmarks import rlvr_step_breakdown

    row = {"step": 1, "time/sync_weights_s": 0.1, "time/generate_s": 0.2, "time/reference_and_old_log_probs_s": 0.3}
    row |= {"time/actor_update_s": 0.3, "phase/generate/residency_s": 0.05, "time/step_s": 1.0}
    row |= {"time/worker_compute_s": 0.8, "time/overhead_fraction": 0.2}
    lines = rlvr_step_breakdown.table([row, row]).splitlines()
    phases = [line.split(" | ")[0].removeprefix("| ") for line in lines[2:6]]
    assert phases == ["sync_weights", "generate", "reference_and_old_log_probs", "actor_update"]
    assert "| reference_and_old_log_probs | 0.300 | 30.0% |" in lines
    assert "| **framework overhead** | 0.200 | **20.0%** |" in lines


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_writes_docs_into_blocks_its_doc_has(name: str) -> None:
    module = importlib.import_module(f"benchmarks.{name}")
    args, _ = module.build_parser().parse_known_args(["--write-docs"])
    assert args.write_docs is True
    assert module.DOC.parent == doc_tables.DOCS and module.BLOCKS
    for block in module.BLOCKS:
        body = doc_tables.read_block(module.DOC, block)  # raises naming the doc and the marker if it is gone
        assert body.strip(), f"{module.DOC.name}: block {block!r} is empty"


def test_zero_memory_write_docs_refuses_settings_the_doc_has_no_block_for() -> None:
    from benchmarks import zero_memory

    assert zero_memory.parse_args(["--write-docs", "--hidden", "768"]).write_docs
    with pytest.raises(SystemExit):
        zero_memory.parse_args(["--write-docs", "--stages", "1", "--accumulation", "1"])
