"""The Dockerfile installs what a checkout installs: its targets follow setup_env.sh and the README's GPU install."""

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


def test_the_cuda_image_installs_the_pinned_torch_and_the_gpu_requirements() -> None:
    pinned = re.search(r"^torch==(\S+)$", (REPO_ROOT / "requirements_torch.txt").read_text(), re.M)
    assert pinned is not None
    cuda = stage("cuda")
    assert f"torch=={pinned.group(1)} --index-url https://download.pytorch.org/whl/cu" in cuda
    readme = (REPO_ROOT / "README.md").read_text()
    gpu_install = readme[readme.index("## GPU install") :].split("```bash\n")[1].split("```")[0]
    for requirement_file in re.findall(r"-r (\S+)", gpu_install):
        assert f"-r {requirement_file}" in cuda, requirement_file
    assert "--no-deps -e ." in cuda


def test_the_build_context_leaves_out_environments_and_outputs() -> None:
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert {".venv", "output", ".git"} <= set(ignored)
