"""The base class of every role's Ray actor: rank environment, thread cap, rank coordinates."""

from __future__ import annotations

import logging
import os
import socket
import warnings
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING

from roll.configs.worker_config import WorkerConfig
from roll.distributed.scheduler.decorator import Dispatch, register
from roll.distributed.scheduler.rank_layout import RankInfo
from roll.platforms import current_platform
from roll.third_party.deepspeed.cpu_info import reuse_cpu_info
from roll.third_party.deepspeed.op_builds import use_environment_builds
from roll.utils.console import configure_worker_logging
from roll.utils.fileio import write_pid_file
from roll.utils.startup_gc import end_startup

if TYPE_CHECKING:
    import torch.distributed

# How long ranks wait for each other at the rendezvous (torch's default process-group timeout).
RENDEZVOUS_TIMEOUT_S = 1800.0


class Worker:
    """One rank of a role. Subclasses add `@register`-ed methods; the Cluster exposes them.

    The Cluster gives each worker its rank's variables (`env`: RANK, WORLD_SIZE, LOCAL_RANK, ROLL_NUM_THREADS, the
    run's logging), which the constructor puts in the process environment before anything reads them, so
    `torch.distributed` (or DeepSpeed) can initialise from the environment; MASTER_ADDR and MASTER_PORT follow from
    the rendezvous. A strategy that shards over tensor or pipeline ranks sets `rank_info` during initialisation.
    With `ROLL_PID_DIR` set (in the driver's environment or a role's `env_vars`), each worker writes its pid to
    `<dir>/<role>-<rank>.pid`, for tools outside the run (tests that kill a worker, benchmarks/scale_memory.py).
    """

    def __init__(self, worker_config: WorkerConfig, env: Mapping[str, str] | None = None) -> None:
        end_startup()  # this process's imports are done (roll/utils/startup_gc.py)
        os.environ.update(env or {})
        configure_worker_logging()  # warnings to the console, the detail to the run's workers.log
        import torch

        self.worker_config = worker_config
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ["LOCAL_RANK"])
        # Read now: roles sharing a process (worker_host.py) each have their own rendezvous in the same environment.
        self.master = (os.environ.get("MASTER_ADDR", ""), int(os.environ.get("MASTER_PORT") or 0))
        self.platform = current_platform()
        use_environment_builds()  # this process's environment, on whichever node it runs
        reuse_cpu_info()  # DeepSpeed's CPU ops ask about the CPU: once per machine boot, not thrice per process
        self.rank_info = RankInfo(rank=self.rank, dp_rank=self.rank, dp_size=self.world_size)
        self.compute_seconds = 0.0  # time spent inside @register-ed methods
        write_pid_file(f"{worker_config.name}-{self.rank}")
        torch.set_num_threads(int(os.environ.get("ROLL_NUM_THREADS", "1")))
        # DeepSpeed calls collectives torch has renamed, once per bucket: keep worker logs readable.
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
        self.logger = logging.getLogger(f"roll.{worker_config.name}.rank{self.rank}")

    @register(Dispatch.RANK0)
    def open_rendezvous(self) -> tuple[str, int]:
        """Host the role's process-group store on a port the OS picks now; return this node's address and the port.

        The store listens from this call on, so no other process can take the port before the group forms (asking
        for a free port and binding it later left that window open to the node's other runs). MASTER_ADDR and
        MASTER_PORT are set to it, as every other rank has them.
        """
        import ray
        import torch.distributed as dist

        self._rendezvous = dist.TCPStore(
            "0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
        )
        address, port = ray.util.get_node_ip_address(), self._rendezvous.port
        self.join_rendezvous((address, port))
        return address, port

    def join_rendezvous(self, master: tuple[str, int]) -> None:
        """Take the rendezvous rank 0 opened (`open_rendezvous`) as this worker's MASTER_ADDR and MASTER_PORT."""
        self.master = master
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master[0], str(master[1])

    def rendezvous_store(self) -> torch.distributed.Store:
        """The store torch's default process group forms over: the one `open_rendezvous` holds, else (a worker
        started outside a Cluster) one hosted by rank 0 at the MASTER_ADDR:MASTER_PORT it started with, as `env://`
        would."""
        import torch.distributed as dist

        store = getattr(self, "_rendezvous", None)
        if store is None:
            store = self._rendezvous = dist.TCPStore(
                self.master[0],
                self.master[1],
                is_master=self.rank == 0,
                wait_for_workers=False,
                timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
            )
        return store

    def close(self) -> None:
        """Release what this worker started (engines, child processes); Cluster.shutdown calls it before the kill."""

    @register(Dispatch.ONE_TO_ALL)
    def pop_compute_seconds(self) -> float:
        """Seconds spent in registered methods since the last call (this call's own time excluded)."""
        seconds, self.compute_seconds = self.compute_seconds, 0.0
        return seconds

    @register(Dispatch.ONE_TO_ALL)
    def get_rank_info(self) -> RankInfo:
        """This rank's data/tensor/pipeline coordinates."""
        return self.rank_info

    @register(Dispatch.ONE_TO_ALL)
    def describe(self) -> dict[str, object]:
        """Where this rank runs: host, pid, device, visible devices and thread cap."""
        import torch

        env = self.platform.visible_devices_env
        return {
            "role": self.worker_config.name,
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "device": self.platform.device_name(self.local_rank),
            "visible_devices": os.environ.get(env, "") if env else "",
            "threads": torch.get_num_threads(),
        }
