"""Handing a bucket to an inference worker on the same node: shared memory on CPU, CUDA IPC on GPUs.

The sender packs the bucket into one flat buffer. On CPU the buffer goes into Ray's object store
(shared memory on the node) as a numpy array, which the receiver maps without a copy. On a GPU
only a CUDA IPC handle of the buffer travels; the receiver opens it on the same physical device
(the SyncPlan pairs a worker with the training rank on its first device, which is the worker's
current device, so the handle's device index is replaced by it). The sender keeps the buffer alive
until every receiver has loaded from it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch

from roll.distributed.weight_sync.buckets import NamedTensors, TensorSpec, pack_flat, unpack_flat


@dataclass
class SharedBucket:
    """A packed bucket as it travels: the flat buffer (CPU) or its IPC handle (GPU), and its specs."""

    specs: list[TensorSpec]
    host_buffer: np.ndarray | None = None
    ipc_handle: tuple[Any, tuple] | None = None
    nbytes: int = 0


def share_bucket(bucket: NamedTensors) -> tuple[SharedBucket, torch.Tensor]:
    """The bucket packed for a receiver on this node, and the flat buffer the sender must keep alive meanwhile."""
    flat, specs = pack_flat(bucket)
    if flat.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        torch.cuda.current_stream(flat.device).synchronize()  # the packing copies must land before the reader looks
        return SharedBucket(specs, ipc_handle=reduce_tensor(flat), nbytes=flat.numel()), flat
    return SharedBucket(specs, host_buffer=flat.numpy(), nbytes=flat.numel()), flat


def open_bucket(shared: SharedBucket) -> NamedTensors:
    """The named tensors of a shared bucket, as views of the sender's buffer (read them, do not write)."""
    if shared.ipc_handle is not None:
        rebuild, args = shared.ipc_handle
        # Argument 6 is the sender's device index; the same GPU is this worker's current device.
        args = (*args[:6], torch.cuda.current_device(), *args[7:])
        flat = rebuild(*args)
    else:
        with warnings.catch_warnings():
            # Ray maps the object store read-only; the views are only ever copied from.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            flat = torch.from_numpy(shared.host_buffer)
    return unpack_flat(flat, shared.specs)


def hand_over(
    buckets: Iterable[NamedTensors],
    targets: list[Any],
    totals: dict[str, int],
    in_process: Sequence[Any] = (),
    share: bool = False,
) -> Iterator[NamedTensors]:
    """Pass each bucket on while every target actor loads it (`receive_colocated_bucket`), then wait for them.

    The bucket goes into the object store once, whatever the number of targets; workers in this very process
    (`in_process`, worker_host.py) load it from the sender's tensors with `load_bucket` instead, and with `share`
    (the tensors are the sender's live parameters) may keep them rather than copy them. The bytes handed
    over accumulate in `totals["colocated_bytes"]`. The targets load bucket k while the caller
    broadcasts it: an inference role whose workers load collectively (ZeRO-3) may have workers on
    both routes, and its colocated workers cannot finish bucket k before the broadcast ones have it.
    """
    for bucket in buckets:
        for worker in in_process:
            totals["colocated_bytes"] += worker.load_bucket(bucket, share)
        if not targets:
            yield bucket
            continue
        shared, buffer = share_bucket(bucket)
        ref = ray.put(shared)
        loads = [target.receive_colocated_bucket.remote(ref) for target in targets]
        yield bucket
        ray.get(loads)  # before the next bucket, and before the buffer is released
        totals["colocated_bytes"] += shared.nbytes * len(targets)
        del ref, buffer
