"""The Dockerfile installs what a checkout installs: both targets run scripts/setup_env.sh."""

from __future__ import annotations

import re

from tests.conftest import REPO_ROOT

DOCKERFILE = (REPO_ROOT / "Dockerfile").read_text()


def stage(name: str) -> str:
    """The instructions of one build target."""
    parts = re.split(r"^FROM ", DOCKERFILE, flags=re.M)
    (body,) = [part for part in parts if re.match(rf"\S+ AS {name}\n", part)]
    return body


def test_the_cpu_image_is_built_by_the_projects_own_setup() -> None:
    assert "RUN bash scripts/setup_env.sh" in stage("cpu")


def test_the_cuda_image_is_built_by_the_same_setup_for_the_cuda_stack() -> None:
    cuda = stage("cuda")
    assert re.search(r"^RUN ROLL_DEVICE=cuda .*bash scripts/setup_env.sh$", cuda, re.M), cuda
    assert "pip install" not in cuda, "every pip install of the image goes through scripts/setup_env.sh"


def test_the_build_context_leaves_out_environments_and_outputs() -> None:
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert {".venv", "output", ".git"} <= set(ignored)
