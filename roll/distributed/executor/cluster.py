"""A role as a group of Ray actors, with the worker's registered methods as cluster methods."""

from __future__ import annotations

import functools
import inspect
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import ray

from roll.configs.worker_config import WorkerConfig
from roll.distributed.executor.actor_exit import end_actors
from roll.distributed.executor.worker import Worker
from roll.distributed.executor.worker_host import HostedWorker, WorkerHost, actor_of
from roll.distributed.scheduler.decorator import DISPATCH_ATTR, Dispatch, collect_results, dispatch_args
from roll.distributed.scheduler.rank_layout import RankInfo
from roll.distributed.scheduler.resource_manager import ResourceManager, WorkerPlacement
from roll.utils.console import worker_env
from roll.utils.imports import import_object

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A worker's process died during a call (killed, out of memory, crashed); the message names it and its node."""


class ClusterFuture:
    """The pending result of a non-blocking cluster call; `get()` waits and collects it.

    `callees` names the worker behind each ref (`role rank r`) and holds its actor handle.
    """

    def __init__(
        self,
        refs: list[ray.ObjectRef],
        collect: Callable[[list[Any]], Any],
        callees: list[tuple[str, ray.actor.ActorHandle]],
    ) -> None:
        self.refs = refs
        self._collect = collect
        self.callees = callees

    def get(self, timeout: float | None = None) -> Any:
        """Wait for every called rank and combine their results as the dispatch mode says.

        The first failure is raised as soon as it happens, not after the other ranks finish (they may
        wait for the failed one forever); a dead worker is a WorkerDiedError naming it.
        """
        _wait_failing_fast([self], timeout)
        return self._collect(ray.get(self.refs))

    def kill_unfinished(self) -> list[str]:
        """Kill the workers whose call is still running; return their names."""
        finished, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        stuck = [callee for ref, callee in zip(self.refs, self.callees, strict=True) if ref not in finished]
        for _, worker in stuck:
            ray.kill(worker, no_restart=True)
        return [name for name, _ in stuck]


def _wait_failing_fast(futures: list[ClusterFuture], timeout: float | None = None) -> None:
    """Wait until every call of `futures` finished; raise the first failure at once (GetTimeoutError at `timeout`)."""
    pending = [ref for future in futures for ref in future.refs]
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        if not ready:
            raise ray.exceptions.GetTimeoutError(f"{len(pending)} call(s) still running after {timeout} s")
        try:
            ray.get(ready)
        except ray.exceptions.RayActorError as exc:
            raise WorkerDiedError(_death_message(exc, futures)) from exc


def _death_message(exc: ray.exceptions.RayActorError, futures: list[ClusterFuture]) -> str:
    """'<role> rank <r> died (node <ip>, pid <pid>): <Ray's reason>' from Ray's actor-death error."""
    names = {worker._actor_id.hex(): name for future in futures for name, worker in future.callees}
    text = str(exc)
    name = names.get(getattr(exc, "actor_id", None) or "", "a worker")
    ip, pid = (re.search(rf"^\s*{key}: (\S+)$", text, re.MULTILINE) for key in ("ip", "pid"))
    where = f" (node {ip[1]}, pid {pid[1]})" if ip and pid else ""
    reason = re.search(r"(The actor is dead because.*?\.)", text, re.DOTALL)
    detail = re.search(r"Worker exit detail: (.*?\.)", text, re.DOTALL)
    because = " ".join(m[1].replace("\n", " ") for m in (reason, detail) if m) or text.splitlines()[0]
    return f"{name} died{where}: {because}"


def get_all(*futures: ClusterFuture, abort_grace_s: float | None = None) -> list[Any]:
    """The results of calls that run together, raising the first failure as soon as it happens.

    Waiting on the futures one by one would hang on a call whose partner in another cluster failed.
    With `abort_grace_s`, the calls still running after a failure get that long to end (their
    partner's abort may release them); the workers of those that do not, stuck in a collective or a
    wait the failed call left, are killed and named in the error, so no participant waits forever.
    """
    try:
        _wait_failing_fast(list(futures))
    except Exception as exc:
        if abort_grace_s is None:
            raise
        pending = [ref for future in futures for ref in future.refs]
        ray.wait(pending, num_returns=len(pending), timeout=abort_grace_s)
        death = exc if isinstance(exc, WorkerDiedError) else _death_among(futures, exc)  # before any kill below
        killed = [name for future in futures for name in future.kill_unfinished()]
        if killed:
            raise (RuntimeError if death is None else WorkerDiedError)(
                f"{death or exc}\n{', '.join(killed)} still waited on the failed call after {abort_grace_s:.0f} s and "
                "were stopped; their roles cannot continue, so the run must end (resume from its last checkpoint)"
            ) from exc
        if death is not None and death is not exc:
            raise death from exc
        raise
    return [future.get() for future in futures]


def _death_among(futures: tuple[ClusterFuture, ...], failure: Exception) -> WorkerDiedError | None:
    """A WorkerDiedError naming a worker of `futures` whose process died, if one did: the cause of `failure`, a
    partner's error in a collective with it (e.g. gloo's "Connection closed by peer"), which came first."""
    refs = [ref for future in futures for ref in future.refs]
    finished, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    for ref in finished:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            return WorkerDiedError(f"{_death_message(exc, list(futures))} (and so: {str(failure).splitlines()[0]})")
        except Exception:
            continue
    return None


def resolve_worker_cls(worker_cls: type[Worker] | str) -> type[Worker]:
    """The Worker class itself, or the one a dotted path `package.module.Class` names."""
    cls = worker_cls if isinstance(worker_cls, type) else import_object(worker_cls, "worker_cls")
    if not (isinstance(cls, type) and issubclass(cls, Worker)):
        raise ValueError(f"worker_cls {worker_cls!r} is not a subclass of roll Worker")
    return cls


def rank_envs(
    config: WorkerConfig, resource_manager: ResourceManager, placements: list[WorkerPlacement]
) -> list[dict[str, str]]:
    """Each rank's environment: the run's logging (its log file and verbosity: the jobs of a sweep share one Ray,
    not one log file), the role's `env_vars`, its placement's variables, rank, world size and threads."""
    if config.devices:
        threads = resource_manager.threads_per_worker(config.num_devices_per_worker)
    else:
        threads = max(1, int(config.num_cpus_per_worker))
    return [
        {
            **worker_env(),
            **config.env_vars,
            **placement.env,
            "RANK": str(rank),
            "WORLD_SIZE": str(len(placements)),
            "ROLL_NUM_THREADS": str(threads),
            "OMP_NUM_THREADS": str(threads),
        }
        for rank, placement in enumerate(placements)
    ]


def process_start_options(config: WorkerConfig, placement: WorkerPlacement) -> dict[str, Any]:
    """The Ray options that give a rank's process what must be in place before it starts: the role's `env_vars` (a
    library may read them on import) and the placement's device-visibility variables (Ray reads its own at the
    actor's start). The rest of the rank's environment goes through the worker's constructor: an actor with a
    `runtime_env` of its own cannot take one of the idle worker processes Ray keeps started, which costs it a
    process start (about 0.8 s on 2 cores)."""
    env = {**config.env_vars, **{k: v for k, v in placement.env.items() if k != "LOCAL_RANK"}}
    return {**placement.ray_options, **({"runtime_env": {"env_vars": env}} if env else {})}


def start_hosts(config: WorkerConfig, resource_manager: ResourceManager, label: str) -> list[ray.actor.ActorHandle]:
    """A WorkerHost per rank of `config`'s layout (roles with the same devices go in them), named after `label`.
    Each role's rank variables come with its `WorkerHost.add`."""
    placements = resource_manager.place(config)
    return [
        ray.remote(WorkerHost)
        .options(name=f"{label}-{rank}-{id(placements):x}", **process_start_options(config, placement))
        .remote()
        for rank, placement in enumerate(placements)
    ]


class Cluster:
    """`worker_config.world_size` actors of `worker_cls`, one per rank, placed by `resource_manager`.

    Every method of the worker marked with `@register(mode)` becomes a method of the cluster with
    the same name: `cluster.compute_log_probs(batch)` fans out as `mode` says and returns the
    collected result; `blocking=False` returns a ClusterFuture instead.
    """

    def __init__(
        self,
        worker_cls: type[Worker] | str,
        worker_config: WorkerConfig,
        resource_manager: ResourceManager,
        hosts: list[ray.actor.ActorHandle] | None = None,
    ) -> None:
        self.name = worker_config.name
        self.worker_cls = resolve_worker_cls(worker_cls)
        self.worker_config = worker_config
        self.world_size = worker_config.world_size or 1
        self.workers: list[ray.actor.ActorHandle | HostedWorker] = []
        self._rank_infos: list[RankInfo] | None = None
        self._bind_registered_methods()  # a naming error must come before any actor starts
        self._start_workers(resource_manager, hosts)

    def _start_workers(self, resource_manager: ResourceManager, hosts: list[ray.actor.ActorHandle] | None) -> None:
        """Start every rank without waiting for any: in actors of their own, or in `hosts` (one per rank)."""
        placements = resource_manager.place(self.worker_config)
        for rank, env in enumerate(rank_envs(self.worker_config, resource_manager, placements)):
            if hosts:
                hosts[rank].add.remote(self.name, self.worker_cls, self.worker_config, env)
                self.workers.append(HostedWorker(hosts[rank], self.name))
                continue
            actor = ray.remote(self.worker_cls).options(
                name=f"{self.name}-{rank}-{id(self):x}",
                **process_start_options(self.worker_config, placements[rank]),
            )
            self.workers.append(actor.remote(self.worker_config, env))
        # Rank 0 hosts the rendezvous: its node's address (not the driver's) and a port it holds from then on become
        # every rank's master. Ray runs each rank's join after its start and before any later call.
        master = self.workers[0].open_rendezvous.remote()
        for worker in self.workers[1:]:
            worker.join_rendezvous.remote(master)

    def _bind_registered_methods(self) -> None:
        for name, member in inspect.getmembers(self.worker_cls, inspect.isfunction):
            mode = getattr(member, DISPATCH_ATTR, None)
            if mode is None:
                continue
            if hasattr(Cluster, name) or name in vars(self):
                # e.g. a registered `shutdown` would replace Cluster.shutdown and the actors would never stop.
                raise TypeError(
                    f"{self.worker_cls.__name__}.{name} is registered but Cluster has its own {name!r}; rename it"
                )
            setattr(self, name, functools.partial(self.call, name, mode))

    @property
    def rank_infos(self) -> list[RankInfo]:
        """Every rank's coordinates, asked once from the workers (strategies may set them)."""
        if self._rank_infos is None:
            self._rank_infos = ray.get([w.get_rank_info.remote() for w in self.workers])
        return self._rank_infos

    def call(self, method: str, mode: Dispatch, *args: Any, blocking: bool = True, **kwargs: Any) -> Any:
        """Run worker `method` on the ranks `mode` picks; return the result or, non-blocking, a future."""
        ranks = (
            self.rank_infos
            if mode is Dispatch.DP_COMPUTE
            else [RankInfo(rank=r, dp_rank=r, dp_size=self.world_size) for r in range(self.world_size)]
        )
        calls = dispatch_args(mode, ranks, args, kwargs)
        refs = [getattr(self.workers[rank], method).remote(*a, **kw) for rank, a, kw in calls]
        called = [rank for rank, _, _ in calls]
        callees = [(f"{self.name} rank {rank}", actor_of(self.workers[rank])) for rank in called]
        future = ClusterFuture(refs, functools.partial(collect_results, mode, ranks, called), callees)
        return future.get() if blocking else future

    def shutdown(self, close_timeout_s: float = 60) -> None:
        """Let every actor release what it started (`Worker.close`: engines, child processes), then kill it; a worker
        in a WorkerHost is closed and removed from its host instead (the host holds other roles too: its owner stops
        it). Closed actors exit normally (their `atexit` handlers run); the others are killed."""
        closing = [
            worker.host.remove.remote(worker.role) if isinstance(worker, HostedWorker) else worker.close.remote()
            for worker in self.workers
        ]
        own = [worker for worker in self.workers if not isinstance(worker, HostedWorker)]
        try:
            ray.get(closing, timeout=close_timeout_s)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
            logger.warning("%s: closing its workers failed (%s); killing them", self.name, exc)
            for worker in own:
                ray.kill(worker, no_restart=True)
        else:
            end_actors(own)
        self.workers.clear()
