"""The deployment routes of docs/deployment.md, run here as far as one machine allows.

`ray job submit` to a head started with `ray start`, and the SLURM batch script (under stand-ins for
`scontrol` and `srun` that run every step on this machine), which starts Ray by hand and runs the
driver on the head with RAY_ADDRESS, as a user does. The KubeRay manifest is checked for
the entrypoint the docs give; running it needs a Kubernetes cluster.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import yaml

from roll.pipeline.base.preemption import PREEMPTED_EXIT_CODE
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow
VENV_BIN = Path(sys.executable).parent
# The lightest roll run that proves a route: the cluster check's two roles on one device, one rank each, one round.
# Their data-parallel groups across devices and nodes are test_cluster.py's and test_multinode.py's subject.
ONE_DEVICE = ["devices_per_node=1", "actor_train.device_mapping=0", "actor_infer.device_mapping=0"]
CHECK = ["examples/start_cluster_check.py", *ONE_DEVICE, "platform=cpu", "rounds=1"]
PASSED = "cluster check passed: 2 role(s) on 1 device(s)"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def environment(**extra: str) -> dict[str, str]:
    """This environment with the venv's tools first on PATH, and no Ray address inherited from the tests.

    `ray start` turns Ray's token authentication on; a driver that connects by address must ask for it.
    """
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    path = f"{VENV_BIN}{os.pathsep}{env['PATH']}"
    return env | {"PATH": path, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token"} | extra


def wait_for_head(dashboard_port: int, agent_port: int, timeout_s: float = 120) -> None:
    """Wait until the head's GCS (asked through its dashboard) and its raylet (through its dashboard agent, the one
    that takes jobs) answer their health checks: public endpoints, asked over HTTP from this process, where a Python
    that imports Ray for each try would cost seconds of CPU."""
    checks = (f"{dashboard_port}/api/gcs_healthz", f"{agent_port}/api/local_raylet_healthz")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            for check in checks:
                with urllib.request.urlopen(f"http://127.0.0.1:{check}", timeout=5) as response:
                    assert response.status == 200
            return
        except (OSError, AssertionError):
            time.sleep(0.5)
    raise AssertionError(f"the Ray head (dashboard port {dashboard_port}) did not come up")


def submit_job(job_server: str, entrypoint: list[str], timeout_s: float = 120) -> subprocess.CompletedProcess:
    """`ray job submit` as a user runs it, tried again while the head's job agent has not registered yet.

    Just after `ray start --head` the job server can answer before its agent has joined; Ray then
    refuses the job with "No available agent ... please try again later" and has started nothing.
    """
    command = ["ray", "job", "submit", f"--address={job_server}", "--working-dir=.", "--", *entrypoint]
    deadline = time.monotonic() + timeout_s
    while True:
        result = subprocess.run(command, cwd=REPO_ROOT, env=environment(), capture_output=True, text=True, timeout=600)
        if "No available agent" not in result.stderr or time.monotonic() > deadline:
            return result
        time.sleep(3)


@pytest.fixture
def head() -> Iterator[tuple[str, str]]:
    """`ray start --head --block` as a user starts it; yields the GCS address and the job server's URL.

    The job agent gets a free port of its own: the test session's Ray already holds the default (52365),
    and a head whose agent cannot bind refuses every job ("No available agent to submit job").
    """
    port, dashboard, agent = free_port(), free_port(), free_port()
    command = ["ray", "start", "--head", f"--port={port}", f"--dashboard-port={dashboard}", "--num-cpus=4", "--block"]
    command.append(f"--dashboard-agent-listen-port={agent}")
    process = subprocess.Popen(command, env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_head(dashboard, agent)
        yield f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard}"
    finally:
        process.terminate()  # --block stops the node's processes when it is told to end
        process.wait(timeout=60)


def test_a_run_submitted_with_ray_job_submit(head: tuple[str, str]) -> None:
    _, job_server = head
    submitted = submit_job(job_server, ["python", *CHECK])
    assert submitted.returncode == 0 and PASSED in submitted.stdout, (submitted.stdout + submitted.stderr)[-3000:]


def one_node_allocation(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The batch script's environment under stand-ins that treat this machine as a one-node allocation (`extra`
    last); `scontrol requeue JOB` writes JOB to `tmp_path/requeued`."""
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "scontrol").write_text(
        '#!/usr/bin/env bash\n[[ "$1 $2" == "show hostnames" ]] && hostname\n'
        f'[[ "$1" == requeue ]] && echo "$2" > {tmp_path / "requeued"}\ntrue\n'
    )
    # srun --nodes=1 --ntasks=1 -w NODE COMMAND...: run COMMAND here.
    (shims / "srun").write_text('#!/usr/bin/env bash\nshift 4\nexec "$@"\n')
    for shim in shims.iterdir():
        shim.chmod(0o755)
    return (
        environment(
            PATH=f"{shims}{os.pathsep}{environment()['PATH']}",
            SLURM_JOB_NODELIST="node-a",
            SLURM_SUBMIT_DIR=str(REPO_ROOT),
            ROLL_VENV=str(VENV_BIN.parent),
            RAY_PORT=str(free_port()),
            CPUS_PER_NODE="4",
        )
        | extra
    )


def test_the_slurm_script_runs_a_job_on_its_allocation(tmp_path: Path) -> None:
    """The batch script under stand-ins that treat this machine as a one-node allocation."""
    result = subprocess.run(
        ["bash", "scripts/deploy/slurm_ray.sbatch", *CHECK],
        cwd=REPO_ROOT,
        env=one_node_allocation(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0 and PASSED in result.stdout, (result.stdout + result.stderr)[-3000:]


def test_the_slurm_script_passes_sigterm_to_the_run_and_requeues_it_on_status_75(tmp_path: Path) -> None:
    """SLURM's pre-stop SIGTERM (--signal=B:TERM) reaches the batch script: it passes it to the run, which stops as
    roll's entry points do (exit 75, PREEMPTED_EXIT_CODE, here a stand-in program), and the job is requeued. A
    requeued job (SLURM_RESTART_COUNT > 0) runs with resume_from_checkpoint=auto appended."""
    # The handler before the line the test waits for: a SIGTERM right after it must find the handler in place.
    program = (
        f"import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit({PREEMPTED_EXIT_CODE})); "
        "print('arguments', sys.argv[1:], flush=True); time.sleep(300)"
    )
    # Ray stood in for too (this test is about the script's signals, not Ray): `ray start --block` waits, the token is
    # a word, and the venv's python answers the script's two questions about Ray before running the program.
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "ray").write_text('#!/usr/bin/env bash\n[[ "$1" == start ]] && exec sleep 300\necho token\n')
    (venv / "python").write_text(
        "#!/usr/bin/env bash\n"
        'case "$*" in *get_node_ip_address*) echo 127.0.0.1;; *ray.nodes*) echo 1;; *) exec '
        f'{sys.executable} "$@";; esac\n'
    )
    for stand_in in venv.iterdir():
        stand_in.chmod(0o755)
    env = one_node_allocation(tmp_path, SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="1", ROLL_VENV=str(venv.parent))
    job = subprocess.Popen(
        ["bash", "scripts/deploy/slurm_ray.sbatch", "-c", program],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert job.stdout is not None
        lines = []
        while not lines or not lines[-1].startswith("arguments"):
            line = job.stdout.readline()
            assert line, "".join(lines)[-3000:]
            lines.append(line)
        assert lines[-1].strip() == "arguments ['resume_from_checkpoint=auto']"
        job.send_signal(signal.SIGTERM)
        output, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == PREEMPTED_EXIT_CODE, output[-3000:]
    assert (tmp_path / "requeued").read_text().strip() == "4242"


def test_the_kuberay_job_runs_an_entry_point_of_this_repository() -> None:
    job = yaml.safe_load((REPO_ROOT / "examples" / "kuberay" / "rayjob.yaml").read_text())
    assert job["kind"] == "RayJob" and job["spec"]["shutdownAfterJobFinishes"] is True
    program, script, *arguments = job["spec"]["entrypoint"].split()
    assert program == "python" and (REPO_ROOT / script).is_file()
    config_name = arguments[arguments.index("--config-name") + 1]
    assert (REPO_ROOT / "examples" / "config" / f"{config_name}.yaml").is_file()
    assert job["spec"]["rayClusterSpec"]["rayVersion"] == ray.__version__
