"""Every command the README gives has a verdict for the README test (run it, or why not here)."""

from __future__ import annotations

from tests.conftest import REPO_ROOT
from tests.readme_commands import VERDICTS, Run, read_readme, readme_commands


def test_every_readme_command_has_a_verdict() -> None:
    commands = read_readme(REPO_ROOT)
    missing = [c for c in commands if c not in VERDICTS]
    assert not missing, f"give these README commands a verdict in tests/readme_commands.py: {missing}"
    stale = [c for c in VERDICTS if c not in commands]
    assert not stale, f"these verdicts name commands the README no longer has: {stale}"


def test_a_cheap_form_keeps_the_readme_command() -> None:
    """A cheap form adds arguments (or a filter) to the README's command; it never swaps in another one."""
    for command, verdict in VERDICTS.items():
        if isinstance(verdict, Run):
            assert verdict.command.startswith(command.replace("--model small|medium", "")), command


def test_commands_come_from_bash_blocks_and_prose_spans() -> None:
    text = (
        "Run `bash scripts/run.sh seed=1` or `ray`.\n"
        "```bash\nroll-rlvr a=1 \\\n  b=2   # two overrides\n# a comment\n```\n"
        "```\nnot a command\n```\n"
        "```yaml\nkey: value\n```\n"
    )
    assert readme_commands(text) == ["roll-rlvr a=1 b=2", "bash scripts/run.sh seed=1"]
