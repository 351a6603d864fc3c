"""Every command the README and docs/*.md give has a verdict for the README test (run it, or why not here), and the
test's choice of how to run each (in its own process or from a shell) is the one described."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import REPO_ROOT
from tests.readme_commands import (
    COLLECTION,
    VERDICTS,
    Collected,
    Program,
    Run,
    documented_commands,
    in_process_programs,
    readme_commands,
    shell_runs,
)


def test_every_documented_command_has_a_verdict() -> None:
    commands = documented_commands(REPO_ROOT)
    missing = [c for c in commands if c not in VERDICTS]
    assert not missing, f"give these README or docs/ commands a verdict in tests/readme_commands.py: {missing}"
    stale = [c for c in VERDICTS if c not in commands]
    assert not stale, f"these verdicts name commands neither the README nor docs/ has any more: {stale}"


def test_a_cheap_form_keeps_the_documented_command() -> None:
    """A cheap form adds arguments (or a filter) to the documented command; it never swaps in another one."""
    for command, verdict in VERDICTS.items():
        if isinstance(verdict, Run):
            assert verdict.command.startswith(command.replace("--model small|medium", "")), command


def test_a_selection_checked_in_the_collection_is_a_test_command_beside_it() -> None:
    collected = [command for command, verdict in VERDICTS.items() if isinstance(verdict, Collected)]
    assert collected and all(command.startswith("bash scripts/test.sh") for command in collected), collected
    assert Run(COLLECTION, beside=True) in VERDICTS.values()


def test_commands_come_from_bash_blocks_and_prose_spans() -> None:
    text = (
        "Run `bash scripts/run.sh seed=1` or `ray`.\n"
        "```bash\nroll-rlvr a=1 \\\n  b=2   # two overrides\n# a comment\n```\n"
        "```\nnot a command\n```\n"
        "```yaml\nkey: value\n```\n"
    )
    assert readme_commands(text) == ["roll-rlvr a=1 b=2", "bash scripts/run.sh seed=1"]


def test_the_docs_pages_follow_the_readme_in_the_order_it_links_them(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "See [b](docs/b.md) and docs/a.md, then [b](docs/b.md) again.\n`roll-sft x=1`\n"
    )
    for page in "abc":
        (tmp_path / "docs" / f"{page}.md").write_text(f"```bash\nroll-sft x=1\nroll-rlvr {page}=1\n```\n")
    assert documented_commands(tmp_path) == ["roll-sft x=1", "roll-rlvr b=1", "roll-rlvr a=1", "roll-rlvr c=1"]


def test_dry_runs_and_help_of_entry_points_run_in_process() -> None:
    assert in_process_programs("roll-dpo 'a=${b}' dry_run=true") == [Program(("roll-dpo", "a=${b}", "dry_run=true"))]
    assert in_process_programs("X=1 .venv/bin/python benchmarks/a.py --steps 2 --help") == [
        Program((".venv/bin/python", "benchmarks/a.py", "--steps", "2", "--help"), (("X", "1"),))
    ]
    # scripts/run.sh: its warm start with the `sft.` arguments, then RLVR with the others.
    assert in_process_programs("bash scripts/run.sh sft.seed=1 max_steps=2 dry_run=true") == [
        Program(("python", "examples/start_sft_pipeline.py", "seed=1")),
        Program(("python", "examples/start_rlvr_pipeline.py", "max_steps=2", "dry_run=true")),
    ]
    for command in (
        "roll-sft max_steps=2",  # trains
        "roll-rlvr pretrain=$HOME/model dry_run=true",  # the shell expands it
        "roll-rlvr dry_run=true | grep placement",
        "source .venv/bin/activate; roll-rlvr dry_run=true",
        "python -c 'import roll' --help",
        "tensorboard --logdir output --help",
        "bash scripts/test.sh --help",
    ):
        assert in_process_programs(command) is None, command


def test_each_way_of_starting_roll_runs_from_a_shell_once() -> None:
    runs = [
        Run("roll-rlvr dry_run=true"),
        Run("roll-rlvr max_steps=1"),
        Run("roll-dpo dry_run=true"),
        Run("roll-dpo x=1 dry_run=true"),
        Run("python benchmarks/a.py --help"),
        Run("python benchmarks/b.py --help"),
        Run("python examples/start_sft_pipeline.py dry_run=true"),
        Run("python examples/start_rlvr_pipeline.py max_steps=1"),
        Run("source scripts/cpu_env.sh"),
    ]
    assert shell_runs(runs) == [
        Run("roll-rlvr max_steps=1"),
        Run("roll-dpo dry_run=true"),
        Run("python benchmarks/a.py --help"),
        Run("python examples/start_rlvr_pipeline.py max_steps=1"),
        Run("source scripts/cpu_env.sh"),
    ]
