"""One process per device for the roles that share it (`share_worker_processes`).

Roles colocated on the same devices take turns on them, so a process for each role and rank only
costs: every process imports torch, transformers and DeepSpeed (seconds of CPU each) and holds its
own runtime. A `WorkerHost` actor holds one rank of each role of a group instead; the role's
Cluster calls its workers through `HostedWorker` handles, which look like actor handles, and a
weight sync between two roles of one host hands each bucket over in memory (no copy into Ray's
object store).

Roles join a group only when that is safe in one process: the same devices, slots per worker and
environment, strategies that run in-process (hf_infer, DeepSpeed, FSDP2; engines such as vLLM start
processes of their own and stay apart), at most one role that forms a torch process group (the
DeepSpeed and FSDP2 ones), and no ZeRO-3 role, whose model loading switches transformers' process-wide
ZeRO-3 mode on.

A host outlives its roles when `remove` takes them out one by one (tests reuse hosts this way); `leftovers` then
names whatever a removed role left behind in the process.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray

from roll.configs.worker_config import WorkerConfig
from roll.distributed.executor.worker import Worker
from roll.distributed.strategy.deepspeed_config import zero_stage
from roll.third_party.deepspeed import process_state
from roll.utils.console import configure_worker_logging

# The roles' workers hosted by this process, by role name (empty outside a WorkerHost), and why any failed to start.
HOSTED: dict[str, Worker] = {}
FAILED: dict[str, Exception] = {}
IN_PROCESS_STRATEGIES = frozenset({"hf_infer", "deepspeed_train", "deepspeed_infer", "fsdp2_train", "fsdp2_infer"})
PROCESS_GROUP_STRATEGIES = frozenset({"deepspeed_train", "deepspeed_infer", "fsdp2_train", "fsdp2_infer"})


class WorkerHost:
    """A Ray actor holding one rank of several roles that share its devices; `add` creates a role's worker in it,
    `call` runs one of the worker's methods, `remove` takes the role out again."""

    def __init__(self) -> None:
        configure_worker_logging()  # warnings to the console, the detail to the run's workers.log
        # Restored when the last role leaves: roles set their rank's variables, and the rendezvous its address.
        self.environ = dict(os.environ)

    def add(self, role: str, worker_cls: type[Worker], config: WorkerConfig, env: dict[str, str]) -> None:
        """Create `role`'s worker here with `env` (its rank's variables) set, as a worker process of its own has."""
        os.environ.update(env)
        try:
            HOSTED[role] = worker_cls(config)
        except Exception as exc:
            FAILED[role] = exc
            raise

    def call(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """`role`'s worker's `method(*args, **kwargs)`."""
        if role in FAILED:
            raise RuntimeError(f"{role}'s worker failed to start in this process: {FAILED[role]!r}") from FAILED[role]
        return getattr(HOSTED[role], method)(*args, **kwargs)

    def remove(self, role: str) -> None:
        """Close `role`'s worker (`Worker.close`: its strategy leaves the process group and drops process-wide state)
        and forget it; once no role is left, restore the environment the host started with and collect the garbage,
        so the models and engines of the roles that left are freed."""
        FAILED.pop(role, None)
        worker = HOSTED.pop(role, None)
        try:
            if worker is not None:
                worker.close()
        finally:
            del worker
            if not HOSTED:
                for name in os.environ.keys() - self.environ.keys():
                    del os.environ[name]
                os.environ.update(self.environ)
                gc.collect()

    def leftovers(self) -> list[str]:
        """What the roles that were here left in this process, one description each; empty when the next role finds
        the process as a new host would be: no role, no process group, transformers out of ZeRO-3 mode, DeepSpeed's
        process-wide state reset (`roll.third_party.deepspeed.process_state`), no model or engine alive and the
        host's first environment."""
        found = [f"role {role!r} is still hosted" for role in HOSTED]
        found += [f"role {role!r} failed and was not removed" for role in FAILED]
        distributed = sys.modules.get("torch.distributed")
        if distributed is not None and distributed.is_available() and distributed.is_initialized():
            found.append("torch's default process group is still initialised")
        hf_deepspeed = sys.modules.get("transformers.integrations.deepspeed")
        if hf_deepspeed is not None and hf_deepspeed.is_deepspeed_zero3_enabled():
            found.append("transformers is still in ZeRO-3 mode (an HfDeepSpeedConfig is alive)")
        found += process_state.leftovers()
        found += _live_models()
        changed = sorted(k for k in os.environ.keys() | self.environ.keys() if os.environ.get(k) != self.environ.get(k))
        if changed:
            found.append(f"environment variables differ from the host's start: {', '.join(changed)}")
        return found


def _live_models() -> list[str]:
    """The parts of models (torch modules holding parameters or buffers) and the DeepSpeed engines still alive after a
    garbage collection, counted by type. Modules without either, such as the activation functions transformers
    creates once at import, are no role's."""
    torch_nn = sys.modules.get("torch.nn")
    if torch_nn is None:
        return []
    engine = getattr(sys.modules.get("deepspeed.runtime.engine"), "DeepSpeedEngine", None)
    gc.collect()
    counts: dict[str, int] = {}
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: that would ask every object for its __class__, which some proxies warn about
        if not issubclass(kind, torch_nn.Module):
            continue
        held = getattr(obj, "_parameters", None) or getattr(obj, "_buffers", None)  # None before Module.__init__
        if held or (engine and issubclass(kind, engine)):
            counts[kind.__name__] = counts.get(kind.__name__, 0) + 1
    return [f"{count} {name} object(s) still alive" for name, count in sorted(counts.items())]


class _HostedMethod:
    """`host.call(role, method, ...)` spelled as an actor method: `.remote(...)`."""

    def __init__(self, host: ray.actor.ActorHandle, role: str, method: str) -> None:
        self.host, self.role, self.method = host, role, method

    def remote(self, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        return self.host.call.remote(self.role, self.method, *args, **kwargs)


@dataclass(frozen=True)
class HostedWorker:
    """A role's worker inside a WorkerHost, called as an actor handle is: `worker.method.remote(...)`."""

    host: ray.actor.ActorHandle
    role: str

    def __getattr__(self, method: str) -> _HostedMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        return _HostedMethod(self.host, self.role, method)

    def local(self) -> Worker | None:
        """The worker object, when this process is its host (a weight sync then hands buckets over directly)."""
        here = ray.get_runtime_context().get_actor_id() == self.host._actor_id.hex()
        return HOSTED.get(self.role) if here else None


def actor_of(handle: Any) -> ray.actor.ActorHandle:
    """The Ray actor behind a worker handle: the host of a hosted worker, else the handle itself."""
    return handle.host if isinstance(handle, HostedWorker) else handle


def process_groups(roles: Mapping[str, WorkerConfig]) -> list[tuple[str, ...]]:
    """The groups of two or more roles that can share one process per rank (see the module's docstring)."""
    by_layout: dict[tuple, list[str]] = {}
    for name, role in roles.items():
        strategy = role.strategy_args.strategy_name if role.strategy_args else None
        if not role.devices or strategy not in IN_PROCESS_STRATEGIES:
            continue
        if zero_stage(role.strategy_args.strategy_config or {}) == 3:
            continue
        layout = (tuple(role.devices), role.num_devices_per_worker, tuple(sorted(role.env_vars.items())))
        by_layout.setdefault(layout, []).append(name)
    groups = []
    for names in by_layout.values():
        forming = [n for n in names if roles[n].strategy_args.strategy_name in PROCESS_GROUP_STRATEGIES]
        # A second process-group role keeps a process of its own: one torch default group per process.
        members = [n for n in names if n not in forming[1:]]
        if len(members) > 1:
            groups.append(tuple(members))
    return groups
