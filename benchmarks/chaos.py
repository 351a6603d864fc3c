"""Faults at seeded random moments of an RLVR run, against the same run uninterrupted.

    python benchmarks/chaos.py [--steps 12] [--seed 0] [--faults train infer reward driver] [--write-docs] [OVERRIDE]
    python benchmarks/chaos.py --nodes 2 --faults node [--write-docs]
    python benchmarks/chaos.py --recipe agentic [--write-docs]

The job is the default recipe (rlvr_arithmetic.yaml) cut short as the tests run it: the tiny untrained model, 8
prompts of 4 samples a step, actor_train on two device slots and actor_infer on a third of its own (so killing it
kills no other role), a checkpoint every 2 steps, and a reward on the parity of the response's length (a signal
even untrained samples disagree on, so the weights move). It runs twice as a user starts it, in a process of its
own: once without faults, once with `fault_tolerance.max_restarts` set to the number of worker faults, while this
script injects each fault once the run logged a seeded step (and a step past the previous fault's), a seeded
delay under 0.3 s later:

    train   SIGKILL to actor_train rank 1          the run restarts its roles from the last complete checkpoint
    infer   SIGKILL to actor_infer rank 0          idem
    reward  SIGKILL to the reward worker           idem
    driver  SIGTERM to the driver                  it checkpoints and exits 75; started again, as a requeued job is,
                                                   with resume_from_checkpoint=auto
    node    SIGKILL to 127.0.0.3's raylet and the  (--nodes 2) the run restarts its roles once another node joined
            worker processes it started

For each fault: whether the run went on, the steps it had logged that it computed again (the work since the last
checkpoint), the time Ray and roll took to start the roles again (`fault/recovery_s`), and the time from the fault
to the first step logged after it. Then the final losses and exported weights against the uninterrupted run's.
OVERRIDEs go to both runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import doc_tables  # noqa: E402
from roll.pipeline.base.checkpoint_state import latest_complete_tag  # noqa: E402
from roll.pipeline.base.preemption import PREEMPTED_EXIT_CODE  # noqa: E402

DOC = REPO_ROOT / "docs" / "fault_tolerance.md"
BLOCKS = ("chaos", "chaos_nodes", "chaos_agentic")  # one node, the local cluster of two, the agentic recipe
JOB = (
    "platform=cpu",
    "eval_steps=100",
    "save_steps=2",
    "actor_infer.generating_args.num_return_sequences=4",
    "actor_train.training_args.gradient_accumulation_steps=1",
)
RLVR = (
    "pretrain=tiny://qwen2",
    "rollout_batch_size=8",
    "eval_batch_size=16",
    "actor_infer.generating_args.max_new_tokens=4",
    "rewards.math.reward_fn=tests.reward_functions.parity_reward",
)
ONE_NODE = (
    "actor_train.training_args.per_device_train_batch_size=16",
    "devices_per_node=3",
    "actor_train.device_mapping=0-1",
    "reference.device_mapping=0-1",
    "actor_infer.device_mapping=2",
)
# --nodes 2: a Ray cluster of this machine's loopback addresses (as tests/integration/test_multinode.py builds it),
# a head without CPUs where the drivers connect and two nodes; actor_train and the reference share one device slot,
# actor_infer has the other (Ray decides which node holds which), and the `node` fault kills 127.0.0.3's raylet.
TWO_NODES = (
    "actor_train.training_args.per_device_train_batch_size=32",
    "num_nodes=2",
    "devices_per_node=1",
    "actor_train.device_mapping=0",
    "reference.device_mapping=0",
    "actor_infer.device_mapping=1",
)
# --recipe agentic: agentic_guess_number.yaml as its integration test runs it (a 64-wide one-layer policy, 4 seeds of
# 4 episodes a step, one device slot), its environments in an env worker of their own.
AGENTIC = (
    "--config-name=agentic_guess_number",
    "pretrain='tiny://qwen2?hidden_size=64&num_heads=2&num_kv_heads=1&num_layers=1'",
    "rollout_batch_size=4",
    "actor_train.training_args.per_device_train_batch_size=16",
    "devices_per_node=1",
    "actor_train.device_mapping=0",
    "actor_infer.device_mapping=0",
    "env.eval_episodes=8",
    "env.num_env_workers=1",
)
# recipe: (entry point, its overrides, its run directory's name)
RECIPES = {
    "rlvr": ("start_rlvr_pipeline.py", RLVR, "rlvr"),
    "agentic": ("start_agentic_pipeline.py", AGENTIC, "agentic_guess_number"),
}
HEAD_IP, NODE_IPS, SPARE_IP, NODE_CPUS = "127.0.0.4", ("127.0.0.2", "127.0.0.3"), "127.0.0.5", 2
SPARE_AFTER_S = 10.0  # how long the lost node stays lost before another joins in its place
# What each fault strikes: the live worker of the last pid file matching a pattern (`<role>-<rank>.pid`, an env
# worker's `env-<pid>.pid`), SIGTERM to the driver (None), or a node (NODE). Env workers are replaced in
# place; the others cost a restart.
NODE = "node"
FAULTS = {
    "train": ("a training worker (actor_train's last rank, SIGKILL)", "actor_train-*"),
    "infer": ("an inference worker (actor_infer rank 0, SIGKILL)", "actor_infer-0"),
    "reward": ("a reward worker (rewards.math rank 0, SIGKILL)", "rewards.math-0"),
    "env": ("an env worker (SIGKILL), replaced in place", "env-*"),
    "driver": ("the driver (SIGTERM), started again", None),
    "node": ("a node: its raylet and workers (SIGKILL), another node joining 10 s later", NODE),
}
DEFAULT_FAULTS = {"rlvr": ["train", "infer", "reward", "driver"], "agentic": ["train", "env", "driver"]}
RESTARTLESS = ("env", "driver")  # faults the run survives without a restart of its roles
TIMEOUT_S = 900.0
COMPARED = ("actor/loss", "actor/grad_norm", "rollout/score_mean")


@dataclass
class Fault:
    """One injected fault and what it cost."""

    name: str
    after_step: int  # injected once this step was logged ...
    delay_s: float  # ... this long later
    at_step: int = 0  # the last step logged when it struck
    resumed_from: int = 0  # the checkpoint's step the run went on from
    injected: bool = False  # False: the run had ended before the fault's moment
    survived: bool = False
    restart_s: float = float("nan")  # fault/recovery_s: every role stopped -> roles started again
    back_s: float = float("nan")  # the fault -> the first step logged after it


def rows_of(run_dir: Path) -> list[dict]:
    """The metrics rows the run logged so far (a half-written last line left out)."""
    try:
        lines = (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll `condition` until true, or exit naming `what` after TIMEOUT_S."""
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


@dataclass
class Setting:
    """Where the runs go: the job's overrides and, on two nodes, the local cluster the drivers connect to."""

    steps: int
    recipe: str
    overrides: list[str]
    cluster: Any = None  # ray.cluster_utils.Cluster with --nodes 2

    @property
    def run_name(self) -> str:
        """The run directory's name under an output directory."""
        return RECIPES[self.recipe][2]

    def lose_node(self) -> None:
        """127.0.0.3 goes as a machine does: its raylet and every process it started (the workers on it) SIGKILLed."""
        import psutil
        from ray._private import ray_constants

        lost = next(node for node in self.cluster.worker_nodes if node.node_ip_address == NODE_IPS[1])
        raylet = psutil.Process(lost.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
        workers = raylet.children(recursive=True)
        self.cluster.remove_node(lost, allow_graceful=False)
        for process in workers:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                continue

    def spare_node(self) -> None:
        """A node like the lost one joins the cluster."""
        self.cluster.add_node(num_cpus=NODE_CPUS, node_ip_address=SPARE_IP)


@contextmanager
def setting(recipe: str, nodes: int, steps: int, overrides: list[str]) -> Iterator[Setting]:
    """The runs' setting: this machine's embedded Ray (one node), or a local cluster of two (RLVR only)."""
    if nodes == 1:
        yield Setting(steps, recipe, [*(ONE_NODE if recipe == "rlvr" else ()), *overrides])
        return
    from ray.cluster_utils import Cluster

    temp_dir = tempfile.mkdtemp(prefix="roll_chaos_ray_", dir="/tmp")
    # Ray would record the head in /tmp/ray/ray_current_cluster, where others' address-less ray.init() would find it.
    with mock.patch("ray._private.utils.write_ray_address"):
        cluster = Cluster(
            initialize_head=True,
            connect=False,
            head_node_args={"num_cpus": 0, "node_ip_address": HEAD_IP, "temp_dir": temp_dir},
        )
    try:
        for ip in NODE_IPS:
            cluster.add_node(num_cpus=NODE_CPUS, node_ip_address=ip)
        cluster.wait_for_nodes()
        yield Setting(steps, recipe, [*TWO_NODES, *overrides], cluster)
    finally:
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def start(output: Path, where: Setting, *extra: str) -> subprocess.Popen:
    """The recipe's entry point in its own process, writing under `output`, its workers' pids in `output/pids`."""
    script, recipe_overrides, _ = RECIPES[where.recipe]
    command = [
        sys.executable,
        str(REPO_ROOT / "examples" / script),
        *recipe_overrides,
        *JOB,
        f"max_steps={where.steps}",
        f"output_dir={output}",
        *where.overrides,
        *extra,
    ]
    (output / "pids").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "ROLL_PID_DIR": str(output / "pids"), "PYTHONPATH": str(REPO_ROOT)}
    if where.cluster is not None:
        env["RAY_ADDRESS"] = where.cluster.address
    log = (output / "driver.log").open("a")
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def checkpointed_step(run_dir: Path) -> int:
    """The step of the run's last complete checkpoint (0 before the first: a restart starts from the beginning)."""
    try:
        return int(latest_complete_tag(run_dir / "checkpoints").removeprefix("step_"))
    except FileNotFoundError:
        return 0


def live_pid(pid_dir: Path, pattern: str) -> int:
    """The pid of the last file matching `pattern` in `pid_dir` whose process is alive."""
    for path in sorted(pid_dir.glob(f"{pattern}.pid"), reverse=True):
        pid = int(path.read_text())
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return pid
    raise SystemExit(f"no live process has a pid file {pattern}.pid in {pid_dir}")


def plan(names: list[str], steps: int, seed: int) -> list[Fault]:
    """Each fault after a distinct seeded step (1 to steps - 3, in order) and a seeded delay under a step's time."""
    rng = random.Random(seed)
    after = sorted(rng.sample(range(1, steps - 2), len(names)))
    rng.shuffle(names)
    return [Fault(name, step, round(rng.uniform(0.0, 0.3), 2)) for name, step in zip(names, after, strict=True)]


def inject(fault: Fault, run: subprocess.Popen, output: Path, where: Setting, previous: int) -> subprocess.Popen:
    """Once the run has logged the fault's step (and a step past `previous`, the last step logged at the fault
    before: a restarted run logs the steps since its checkpoint again), wait its delay, strike, and wait until the
    run logged a step after it. The run's process (a new one after SIGTERM to the driver)."""
    run_dir = output / where.run_name
    threshold = max(fault.after_step, previous + 1)
    wait_until(lambda: any(r["step"] >= threshold for r in rows_of(run_dir)), f"step {threshold}")
    time.sleep(fault.delay_s)
    if run.poll() is not None:
        return run  # the run ended before the fault's moment: not injected, not survived
    fault.at_step = rows_of(run_dir)[-1]["step"]
    restarts = max((r.get("fault/restarts", 0) for r in rows_of(run_dir)), default=0)
    struck = time.monotonic()
    fault.injected = True
    target = FAULTS[fault.name][1]
    if target is None:
        run.send_signal(signal.SIGTERM)
        if run.wait(timeout=TIMEOUT_S) != PREEMPTED_EXIT_CODE:
            return run
        fault.resumed_from = checkpointed_step(run_dir)
        run = start(output, where, "resume_from_checkpoint=auto")
        logged_after = lambda: any(r["step"] > fault.resumed_from for r in rows_of(run_dir))  # noqa: E731
    else:
        if target == NODE:
            where.lose_node()
            time.sleep(SPARE_AFTER_S)
            where.spare_node()
        else:
            os.kill(live_pid(output / "pids", target), signal.SIGKILL)
        if fault.name in RESTARTLESS:
            fault.resumed_from = fault.at_step  # replaced in place: no step is computed again
            logged_after = lambda: any(r["step"] > fault.at_step for r in rows_of(run_dir))  # noqa: E731
        else:
            logged_after = lambda: any(r.get("fault/restarts", 0) > restarts for r in rows_of(run_dir))  # noqa: E731
    wait_until(lambda: logged_after() or run.poll() is not None, f"a step after the {fault.name} fault")
    if run.poll() in (None, 0) and logged_after():
        fault.survived = True
        fault.back_s = time.monotonic() - struck
        if fault.name not in RESTARTLESS:
            # The restarted run's first row follows the checkpoint it resumed from (the save in progress at the fault
            # may have completed before the death was noticed).
            first = next(r for r in rows_of(run_dir) if r.get("fault/restarts", 0) > restarts)
            fault.resumed_from, fault.restart_s = int(first["step"]) - 1, first["fault/recovery_s"]
    return run


def compare(clean: Path, chaos: Path) -> tuple[float, int | None, float]:
    """The largest relative difference of the COMPARED metrics over the steps, the first step where one differs by
    more than 1e-6 (None: none does), and the largest absolute difference of an exported weight."""
    from safetensors.torch import load_file

    expected = {r["step"]: r for r in rows_of(clean)}
    worst, first = 0.0, None
    for row in rows_of(chaos):
        for key in COMPARED:
            if key in row:
                reference = expected[row["step"]][key]
                difference = abs(row[key] - reference) / max(abs(reference), 1e-12)
                worst = max(worst, difference)
                if difference > 1e-6 and first is None:
                    first = int(row["step"])
    weights, reference = (load_file(run / "model" / "model.safetensors") for run in (chaos, clean))
    return worst, first, max((weights[name] - tensor).abs().max().item() for name, tensor in reference.items())


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options; unknown arguments are the runs' Hydra overrides."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--faults",
        nargs="+",
        choices=list(FAULTS),
        help="default: train infer reward driver (agentic: train env driver)",
    )
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1, help="2: a local cluster (the node fault)")
    parser.add_argument("--recipe", choices=list(RECIPES), default="rlvr")
    parser.add_argument(doc_tables.WRITE_DOCS, action="store_true", dest="write_docs")
    return parser


def main() -> None:
    args, overrides = build_parser().parse_known_args()
    args.faults = args.faults or DEFAULT_FAULTS[args.recipe]
    if len(args.faults) > args.steps - 3:
        raise SystemExit(f"--steps {args.steps} leaves room for {args.steps - 3} faults, not {len(args.faults)}")
    if NODE in args.faults and args.nodes != 2:
        raise SystemExit("the node fault needs --nodes 2")
    if args.recipe == "agentic" and (args.nodes != 1 or {"infer", "reward"} & set(args.faults)):
        raise SystemExit("--recipe agentic: one node, its roles in one process, no reward worker (train, env, driver)")
    if args.recipe == "rlvr" and "env" in args.faults:
        raise SystemExit("the env fault needs --recipe agentic (RLVR on prompts has no env worker)")
    workers = sum(name not in RESTARTLESS for name in args.faults)
    faults = plan(list(args.faults), args.steps, args.seed)
    where_runs = setting(args.recipe, args.nodes, args.steps, overrides)
    with tempfile.TemporaryDirectory(prefix="roll-chaos-") as tmp, where_runs as where:
        clean, chaos = Path(tmp) / "clean", Path(tmp) / "chaos"
        started = time.monotonic()
        run = start(clean, where)
        if run.wait() != 0:
            raise SystemExit(f"the uninterrupted run failed; see {clean / 'driver.log'}")
        clean_s = time.monotonic() - started
        started = time.monotonic()
        run = start(chaos, where, f"fault_tolerance.max_restarts={workers}")
        previous = 0
        for fault in faults:
            run = inject(fault, run, chaos, where, previous)
            previous = fault.at_step
            print(fault, flush=True)
        code = run.wait(timeout=TIMEOUT_S)
        chaos_s = time.monotonic() - started
        if code != 0:
            raise SystemExit(f"the run with faults ended with status {code}; see {chaos / 'driver.log'}")
        worst_metric, first_different, worst_weight = compare(clean / where.run_name, chaos / where.run_name)
        final = rows_of(chaos / where.run_name)[-1]["step"]
    lines = [
        "| fault | planned: after step, +s | last step logged | survived | steps computed again | roles restarted (s) "
        "| fault to next step (s) |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for fault in faults:
        lost = max(0, fault.at_step - fault.resumed_from)  # SIGTERM's run checkpoints the step it was in
        lines.append(
            f"| {FAULTS[fault.name][0]} | {fault.after_step}, +{fault.delay_s:.2f} | {fault.at_step} | "
            f"{('yes' if fault.survived else 'no') if fault.injected else 'not injected: the run had ended'} | "
            f"{lost} | {fault.restart_s:.1f} | {fault.back_s:.1f} |"
        )
    text = "\n".join(lines) + (
        f"\n\nThe run with faults reached step {final} of {args.steps} and exited 0 in {chaos_s:.0f} s (uninterrupted:"
        f" {clean_s:.0f} s). Largest relative difference of {', '.join(COMPARED)} at any step: {worst_metric:.1e}"
        f" ({'none over 1e-6' if first_different is None else f'the first over 1e-6 at step {first_different}'});"
        f" largest absolute difference of an exported weight: {worst_weight:.1e}."
    )
    print(text)
    if args.write_docs:
        block = BLOCKS[2] if args.recipe == "agentic" else BLOCKS[args.nodes - 1]
        doc_tables.write_block(DOC, block, doc_tables.command_line(__file__, sys.argv[1:]), text)


if __name__ == "__main__":
    main()
