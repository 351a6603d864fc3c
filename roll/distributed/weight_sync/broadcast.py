"""A process group from training rank 0 to inference ranks, and the bucket protocol over it.

The group is built directly on a TCPStore hosted by the source, apart from torch's default group
(which each role already uses for itself): gloo on CPU, NCCL on GPUs. For every bucket of a sync:

1. the source writes the bucket's tensor specs (names, dtypes, shapes) to the store;
2. every receiving worker checks them against its model and writes its verdict;
3. the source reads all verdicts and writes `go`, or `abort` with the errors, which both sides raise,
   so a wrong name or shape fails the sync before any of that bucket's bytes move and nobody waits
   for a broadcast that will not come;
4. the source broadcasts the tensors one by one in spec order (the order SGLang's
   `update_weights_from_distributed` receives them in).

An empty spec list ends the sync; a source that fails between buckets announces an abort in place of
the next bucket, so receivers raise its error instead of waiting. Headers and verdicts travel
through the store; only tensors go over the group, so engines whose shards join the group themselves
(SGLang, vLLM with several engine processes) receive while their actor handles the protocol.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from roll.distributed.weight_sync.buckets import NamedTensors, TensorSpec, spec_of, tensor_bytes

GROUP_NAME = "roll_weight_sync"
# A receiver waits this long for the next bucket; a sync of a very large model over a slow network
# must fit in it.
DEFAULT_TIMEOUT_S = 1800.0
_GO, _ABORT = "go", "abort:"


def open_store(master_addr: str, master_port: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The group's rendezvous store; the source hosts it and every other member connects."""
    return dist.TCPStore(
        master_addr, master_port, is_master=is_master, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def host_store(timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """The source's store, listening on a port the OS picks as it binds: nothing else on the node can take the
    port between choosing it and hosting the group (a port found free and bound later left that window open)."""
    return open_store("0.0.0.0", 0, is_master=True, timeout_s=timeout_s)


def new_process_group(
    store: dist.Store, rank: int, world_size: int, backend: str, timeout_s: float
) -> dist.ProcessGroup:
    """A gloo or NCCL group of `world_size` members over `store`, independent of torch's default group.

    Its store keys are nested as torch's `_new_process_group_helper` nests them for a group named
    GROUP_NAME, which is how SGLang's `init_weights_update_group` builds its side of the group.
    """
    timeout = timedelta(seconds=timeout_s)
    device = {"gloo": "cpu", "nccl": "cuda"}.get(backend, "")
    named = dist.PrefixStore(f"{GROUP_NAME}/", dist.PrefixStore(GROUP_NAME, store))
    prefixed = dist.PrefixStore(f"{device}/", named)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    raise ValueError(f"weight broadcast backend must be 'gloo' or 'nccl', got {backend!r}")


class SyncAborted(RuntimeError):
    """The source ended the sync with an error in place of the next bucket."""


class SyncHeaders:
    """The per-bucket protocol of steps 1-3 above, in the group's store; `sync` counts finished syncs."""

    def __init__(self, store: dist.Store) -> None:
        self.store = dist.PrefixStore(f"{GROUP_NAME}/headers/", store)
        self.sync = 0
        self._previous_keys = 0  # bucket indices the previous sync used

    def _key(self, index: int, *parts: object) -> str:
        return "/".join(map(str, (self.sync, index, *parts)))

    # source side
    def publish(self, index: int, specs: list[TensorSpec]) -> None:
        """Announce bucket `index` of the current sync (an empty list ends the sync)."""
        self.store.set(self._key(index, "specs"), json.dumps([spec.to_json() for spec in specs]))

    def publish_abort(self, index: int, error: str) -> None:
        """Announce, in place of bucket `index`, that the source failed with `error`."""
        self.store.set(self._key(index, "specs"), json.dumps({"abort": error}))

    def verdicts(self, index: int, receivers: Iterable[int]) -> list[str]:
        """Wait for every receiver's verdict on bucket `index`; return the errors (empty: all accept)."""
        keys = [self._key(index, "verdict", rank) for rank in receivers]
        self.store.wait(keys)
        return [error for key in keys if (error := self.store.get(key).decode())]

    def decide(self, index: int, errors: list[str]) -> None:
        """Tell receivers to take bucket `index`, or to abort the sync with `errors`."""
        self.store.set(self._key(index, "decision"), f"{_ABORT}{'; '.join(errors)}" if errors else _GO)

    def finish(self, buckets: int, receivers: Iterable[int], aborted: bool = False) -> None:
        """End the current sync after `buckets` announced buckets (the end mark follows unless it was aborted).

        The keys of the sync before it go now: every receiver finished that one before this began.
        """
        if not aborted:
            self.publish(buckets, [])
        receivers = list(receivers)
        for index in range(self._previous_keys):
            for name in ("specs", "decision", *(f"verdict/{rank}" for rank in receivers)):
                self.store.delete_key(f"{self.sync - 1}/{index}/{name}")
        self._previous_keys = buckets + 1
        self.sync += 1

    # receiver side
    def read(self, index: int) -> list[TensorSpec]:
        """The specs of bucket `index`, waiting until the source announces it; SyncAborted if it failed instead."""
        header = json.loads(self.store.get(self._key(index, "specs")))
        if isinstance(header, dict):
            raise SyncAborted(header["abort"])
        return [TensorSpec.from_json(spec) for spec in header]

    def report(self, index: int, rank: int, error: str) -> str:
        """Give this receiver's verdict ('' accepts) and return the source's decision: '' to go, else the errors."""
        self.store.set(self._key(index, "verdict", rank), error)
        decision = self.store.get(self._key(index, "decision")).decode()
        return "" if decision == _GO else decision.removeprefix(_ABORT)

    def close_read(self) -> None:
        """This receiver has read the end of the current sync."""
        self.sync += 1


class BroadcastGroup:
    """This process's membership in the weight-broadcast group: rank 0 sends tensors, the others receive.

    `device` is the member's own device; gloo moves host tensors, so with gloo tensors stay on the CPU. The
    source may bring the store it already hosts (`host_store`); the others connect to master_addr:master_port.
    """

    def __init__(
        self,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str,
        device: torch.device | str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        store: dist.TCPStore | None = None,
    ) -> None:
        self.rank = rank
        self.device = torch.device("cpu" if backend == "gloo" else device)
        self.store = store or open_store(master_addr, master_port, rank == 0, timeout_s)
        self.group = new_process_group(self.store, rank, world_size, backend, timeout_s)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()

    def broadcast_bucket(self, bucket: NamedTensors) -> int:
        """Send the bucket's tensors in order (rank 0); return the bytes sent."""
        sent = 0
        for _, tensor in bucket:
            tensor = tensor.to(self.device).contiguous()
            self._broadcast(tensor)
            sent += tensor_bytes(tensor)
        return sent

    def receive_bucket(self, specs: list[TensorSpec]) -> NamedTensors:
        """Receive one bucket into new tensors on this member's device."""
        bucket = [(s.name, torch.empty(s.shape, dtype=s.torch_dtype, device=self.device)) for s in specs]
        for _, tensor in bucket:
            self._broadcast(tensor)
        return bucket


def send_weights(
    headers: SyncHeaders, group: BroadcastGroup, buckets: Iterable[NamedTensors], receivers: list[int]
) -> int:
    """Run one sync as the source (steps 1-4 for every bucket); return the bytes broadcast.

    `receivers` are the group ranks that give verdicts (one per inference worker). Raises
    SyncAborted with the receivers' errors when any of them rejects a bucket; when making a bucket
    fails, the receivers are told before the error is raised.
    """
    sent = count = 0
    try:
        for bucket in buckets:
            headers.publish(count, [spec_of(name, tensor) for name, tensor in bucket])
            errors = headers.verdicts(count, receivers)
            headers.decide(count, errors)
            if errors:
                headers.finish(count + 1, receivers, aborted=True)
                raise SyncAborted(f"an inference worker rejected bucket {count}: {'; '.join(errors)}")
            sent += group.broadcast_bucket(bucket)
            count += 1
    except SyncAborted:
        raise
    except Exception as exc:  # making a bucket failed (a gather, a colocated hand-over): release the receivers
        headers.publish_abort(count, f"the source failed before bucket {count}: {exc!r}")
        headers.finish(count + 1, receivers, aborted=True)
        raise
    headers.finish(count, receivers)
    return sent


def receive_weights(
    headers: SyncHeaders, rank: int, check: Callable[[list[TensorSpec]], None], take: Callable[[list[TensorSpec]], int]
) -> int:
    """Run one sync as a receiving worker whose verdicts carry group rank `rank`; return what `take` reports.

    `check` raises (KeyError/ValueError naming the weight) on specs the model cannot load; `take`
    receives a bucket's tensors and loads them, returning the bytes. A rejected bucket, here or on
    another worker, raises before any of its tensors move.
    """
    loaded = index = 0
    failure = ""  # a bucket this worker failed to load: later buckets are rejected with it, ending the sync
    while True:
        try:
            specs = headers.read(index)
        except SyncAborted as exc:
            headers.close_read()
            raise SyncAborted(f"weight sync aborted at bucket {index}: {exc}") from None
        if not specs:
            break
        error = failure or _check_error(check, specs)
        decision = headers.report(index, rank, error)
        if decision:
            headers.close_read()
            raise SyncAborted(f"weight sync aborted at bucket {index}: {decision}")
        try:
            loaded += take(specs)
        except Exception as exc:  # reported to the source at the next bucket, raised below
            failure = f"loading bucket {index} failed: {exc!r}"
        index += 1
    headers.close_read()
    if failure:
        raise RuntimeError(f"weight sync: {failure}")
    return loaded


def _check_error(check: Callable[[list[TensorSpec]], None], specs: list[TensorSpec]) -> str:
    """`check`'s complaint about `specs` as a message, or '' when it accepts them."""
    try:
        check(specs)
    except (KeyError, ValueError) as exc:
        return str(exc.args[0] if exc.args else exc)
    return ""
