"""Commands run in the test process end as a shell would see them, and leave the process as they found it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.in_process import run_in_process

SCRIPT = """
import os, sys
print("argv", sys.argv, "cwd", os.getcwd(), "MARK", os.environ.get("MARK"))
os.environ["LEAK"] = "1"
sys.path.append("leak")
{end}
"""


@pytest.mark.parametrize(
    ("end", "returncode", "stderr"),
    [
        ("", 0, ""),
        ("sys.exit(3)", 3, ""),
        ("sys.exit('bad input')", 1, "bad input\n"),
        ("raise ValueError('boom')", 1, "ValueError: boom"),
        ("import ray; ray.init()", 1, "a command run in the test process started Ray"),
    ],
)
def test_a_script_ends_with_the_exit_code_a_shell_sees(tmp_path: Path, end: str, returncode: int, stderr: str) -> None:
    (tmp_path / "script.py").write_text(SCRIPT.format(end=end))
    state = (os.getcwd(), dict(os.environ), list(sys.path), list(sys.argv))
    outcome = run_in_process(["python", "script.py", "a", "b"], tmp_path, os.environ | {"MARK": "x"})
    assert outcome.returncode == returncode, outcome
    assert outcome.stdout.startswith(f"argv ['{tmp_path / 'script.py'}', 'a', 'b'] cwd {tmp_path} MARK x"), outcome
    assert stderr in outcome.stderr and ("Traceback" in outcome.stderr) == ("raise" in end or "ray" in end), outcome
    assert (os.getcwd(), dict(os.environ), list(sys.path), list(sys.argv)) == state


def test_a_console_script_runs_the_function_it_wraps(tmp_path: Path) -> None:
    outcome = run_in_process(["roll-sweep-report", "--help"], tmp_path)
    assert outcome.returncode == 0 and outcome.stdout.startswith("usage: roll-sweep-report"), outcome


def test_a_pythonpath_the_command_sets_makes_its_modules_importable(tmp_path: Path) -> None:
    (tmp_path / "agents").mkdir()
    (tmp_path / "agents" / "my_agent.py").write_text("NAME = 'mine'\n")
    (tmp_path / "script.py").write_text("import my_agent\nprint(my_agent.NAME)\n")
    path = list(sys.path)
    outcome = run_in_process(["python", "script.py"], tmp_path, os.environ | {"PYTHONPATH": "agents"})
    assert (outcome.returncode, outcome.stdout) == (0, "mine\n"), outcome
    assert sys.path == path
    sys.modules.pop("my_agent", None)
