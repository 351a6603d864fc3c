"""Worker classes used by the cluster tests; Ray workers import them by module path."""

from __future__ import annotations

import atexit
import os
import time

import torch

from roll.distributed.executor.worker import Worker
from roll.distributed.scheduler.decorator import Dispatch, register
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.scheduler.rank_layout import rank_layout


class EchoWorker(Worker):
    """Reports its environment and transforms DataProto shards."""

    @register(Dispatch.ONE_TO_ALL)
    def environment(self) -> dict[str, str]:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ROLL_PLATFORM")
        return {k: os.environ.get(k, "") for k in keys} | {"threads": str(torch.get_num_threads())}

    @register(Dispatch.DP_COMPUTE)
    def add_rank(self, batch: DataProto, offset: int = 0) -> DataProto:
        x = batch.batch["x"]
        return DataProto.from_dict(
            tensors={"x": x, "y": x * 10 + offset, "rank": torch.full_like(x, self.rank)},
            non_tensors={"tag": [f"r{self.rank}"] * len(x)},
        )

    @register(Dispatch.ONE_TO_ALL)
    def sleep_then_rank(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(Dispatch.RANK0)
    def whoami(self) -> int:
        return self.rank

    @register(Dispatch.ALL_TO_ALL)
    def square(self, value: int) -> int:
        return value * value


class TensorParallelEchoWorker(EchoWorker):
    """Pretends ranks pair up in tensor-parallel groups of 2, as a sharded strategy would."""

    def __init__(self, worker_config, env=None) -> None:
        super().__init__(worker_config, env)
        self.rank_info = rank_layout(self.world_size, tp_size=2)[self.rank]


class TeardownMark:
    """Creates file `path` when the interpreter's teardown frees it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __del__(self, _open=os.open, _close=os.close) -> None:  # the module's globals may be gone by then
        _close(_open(self.path, os.O_CREAT | os.O_WRONLY))


# What this process's teardown would free (a module global): ClosingWorker puts its mark here.
TEARDOWN_MARKS: list[TeardownMark] = []


class ClosingWorker(EchoWorker):
    """Writes a file when Cluster.shutdown lets it close, another when its process exits normally, and a third
    if the interpreter's teardown runs at that exit."""

    def __init__(self, worker_config, env=None) -> None:
        super().__init__(worker_config, env)
        atexit.register(self._mark, "exited")
        TEARDOWN_MARKS.append(TeardownMark(f"{worker_config.env_vars['CLOSED_MARKER']}torn-down-{self.rank}"))

    def _mark(self, what: str) -> None:
        with open(f"{self.worker_config.env_vars['CLOSED_MARKER']}{what}-{self.rank}", "w") as marker:
            marker.write(what)

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self._mark("closed")


class ShadowingWorker(EchoWorker):
    """Registers a method under a name Cluster uses itself."""

    @register(Dispatch.ONE_TO_ALL)
    def shutdown(self) -> None:
        pass
