"""Generation overlapped with training: policy versions, the rollout in flight, and the staleness bound.

With `async_generation_ratio` k >= 1 the driver starts generating the next batch before it trains
on the current one, so a batch may have been sampled by a policy some updates older than the one
it updates. `PolicyVersions` counts the versions (one per actor update) and refuses a batch older
than k; `InFlightRollout` is the generation call still running, with what resuming needs: an actor_infer
call for prompts, or a `BackgroundCall` of the driver playing environment episodes turn by turn.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from roll.distributed.executor.cluster import ClusterFuture
from roll.distributed.scheduler.protocol import DataProto

# non_tensor_batch key: the policy version (actor updates applied) of the weights that sampled each row.
POLICY_VERSION = "policy_version"


class PendingBatch(Protocol):
    """A batch being generated: `get()` waits for it."""

    def get(self) -> DataProto: ...


class BackgroundCall:
    """`call()` running in a thread of the driver (multi-turn episodes, which step environments between
    generate calls); `get()` waits for its result or raises its exception."""

    def __init__(self, call: Callable[[], DataProto], name: str = "roll-episodes") -> None:
        executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._future = executor.submit(call)
        executor.shutdown(wait=False)

    def get(self) -> DataProto:
        """The call's result, once it has returned."""
        return self._future.result()


@dataclass
class PolicyVersions:
    """Policy versions of actor_train (`trained`: updates applied) and of actor_infer's weights (`served`).

    A batch sampled at version `u` and trained at version `v` is `v - u` versions stale; the bound is
    `max_staleness` (the config's `async_generation_ratio`).
    """

    max_staleness: int
    trained: int = 0
    served: int = 0

    def updated(self) -> None:
        """actor_train applied one more update."""
        self.trained += 1

    def synced(self) -> None:
        """actor_infer now holds actor_train's weights."""
        self.served = self.trained

    def staleness_metrics(self, batch: DataProto) -> dict[str, float]:
        """`rollout/staleness_mean` and `_max` of the rows of `batch` if trained now; raise past the bound."""
        lag = self.trained - batch.non_tensor_batch[POLICY_VERSION]
        if len(lag) and lag.max() > self.max_staleness:
            raise RuntimeError(
                f"a batch sampled {int(lag.max())} policy versions ago would be trained, beyond "
                f"async_generation_ratio={self.max_staleness}; the driver's schedule broke its bound"
            )
        return {
            "rollout/staleness_mean": float(lag.mean()) if len(lag) else 0.0,
            "rollout/staleness_max": float(lag.max()) if len(lag) else 0.0,
        }


@dataclass
class ReadyBatch:
    """A batch generated already (the in-flight batch a checkpoint stored), as a pending one."""

    batch: DataProto

    def get(self) -> DataProto:
        """The batch."""
        return self.batch


@dataclass
class InFlightRollout:
    """A generation call for step `step` by the weights of policy `version`.

    A checkpoint saved while it runs waits for its batch and stores it (`save_in_flight`): a resumed run trains on
    the very batch the uninterrupted run trained on, sampled by the same, older, weights.
    """

    step: int
    future: ClusterFuture | PendingBatch
    version: int
    _result: DataProto | None = field(default=None, init=False)

    def result(self) -> DataProto:
        """The generated batch, every row tagged with `version` under `POLICY_VERSION` (waits for it once)."""
        if self._result is None:
            self._result = self.future.get()
            self._result.non_tensor_batch[POLICY_VERSION] = np.full(len(self._result), self.version, dtype=np.int64)
        return self._result


IN_FLIGHT_FILE = "in_flight_batch.pt"


def save_in_flight(rollout: InFlightRollout, directory: Path) -> dict[str, int]:
    """Wait for `rollout`'s batch and write it to `directory`; what `load_in_flight` needs beside it."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(rollout.result(), directory / IN_FLIGHT_FILE)
    return {"step": rollout.step, "version": rollout.version}


def load_in_flight(directory: Path, saved: dict[str, int]) -> InFlightRollout:
    """The in-flight rollout `save_in_flight` stored in `directory`, its batch ready."""
    batch = torch.load(directory / IN_FLIGHT_FILE, weights_only=False)
    return InFlightRollout(saved["step"], ReadyBatch(batch), saved["version"])
