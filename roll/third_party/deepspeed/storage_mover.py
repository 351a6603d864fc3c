"""Moving whole storages off their device and back, repointing every tensor object that views them.

Working on storages rather than tensors keeps DeepSpeed's aliasing intact: a flat buffer, the parameters that are
views into it and the partitions cut from it all move together and come back as views of one new storage, at the
same offsets, so no DeepSpeed bookkeeping has to be rebuilt after a reload.
"""

from __future__ import annotations

import ctypes
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from roll.third_party.deepspeed.spill_file import SpillFile

View = tuple[torch.Tensor, int, torch.Size, tuple[int, ...]]


@dataclass
class StorageGroup:
    """One storage and every tensor object viewing it; `scratch` storages are freed and reallocated, not copied."""

    storage: torch.UntypedStorage
    tensors: list[torch.Tensor]
    scratch: bool = False

    @property
    def nbytes(self) -> int:
        """Size of the storage in bytes."""
        return self.storage.nbytes()


@dataclass
class ParkedStorage:
    """An offloaded storage: where its bytes are, and how each tensor viewed it before."""

    views: list[View]
    nbytes: int
    device: torch.device
    pinned: bool
    scratch: bool
    host: torch.Tensor | None = None
    file_offset: int = -1


def storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """How many tensors and storage handles share `storage` (0 when this torch cannot tell)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return use_count(storage._cdata) if use_count is not None else 0


def _point(views: list[View], storage: torch.UntypedStorage | None, device: torch.device) -> None:
    """Make each tensor view `storage` as it viewed the old one, or hold an empty placeholder when None."""
    for tensor, offset, size, stride in views:
        if storage is None:
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=device)
        else:
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=storage.device).set_(storage, offset, size, stride)


class HostBufferPool:
    """Host buffers kept across offload cycles and reused by size: pinning memory is slow and fragments the host."""

    def __init__(self, allocate: Callable[[int], torch.Tensor]) -> None:
        self._allocate = allocate
        self._free: dict[int, list[torch.Tensor]] = {}

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of `nbytes`, reused when one is free."""
        free = self._free.get(nbytes)
        return free.pop() if free else self._allocate(nbytes)

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer for later offloads."""
        self._free.setdefault(buffer.numel(), []).append(buffer)

    def drop_free(self) -> None:
        """Free the buffers no offload took, so sizes that stopped occurring do not pile up."""
        self._free.clear()


class Parking(ABC):
    """A place storages go while offloaded (`location` names it in reports)."""

    location: str

    def park(self, group: StorageGroup) -> ParkedStorage:
        """Move one storage here and repoint its tensors; the old storage is released once nothing else holds it."""
        storage = group.storage
        parked = ParkedStorage(
            views=[(tensor, tensor.storage_offset(), tensor.size(), tensor.stride()) for tensor in group.tensors],
            nbytes=group.nbytes,
            device=storage.device,
            pinned=storage.device.type == "cpu" and storage.is_pinned(),
            scratch=group.scratch,
        )
        if parked.scratch:
            _point(parked.views, None, parked.device)
        else:
            self._store(storage, parked)
        return parked

    def restore(self, parked: ParkedStorage) -> None:
        """Bring one storage back to its device (pinned again if it was) and repoint its tensors."""
        storage = torch.empty(parked.nbytes, dtype=torch.uint8, device=parked.device, pin_memory=parked.pinned)
        if not parked.scratch:
            self._load(parked, storage)
        _point(parked.views, storage.untyped_storage(), parked.device)
        self._release(parked)

    def park_all(self, groups: list[StorageGroup]) -> list[ParkedStorage]:
        """Park every group, or none: on an error the groups already parked are restored before it propagates."""
        parked: list[ParkedStorage] = []
        try:
            for group in groups:
                parked.append(self.park(group))
        except BaseException:
            for done in reversed(parked):
                self.restore(done)
            raise
        return parked

    @abstractmethod
    def _store(self, storage: torch.UntypedStorage, parked: ParkedStorage) -> None:
        """Copy the storage's bytes here and repoint the parked views."""

    @abstractmethod
    def _load(self, parked: ParkedStorage, destination: torch.Tensor) -> None:
        """Copy the parked bytes into `destination` (uint8, on the original device)."""

    def _release(self, parked: ParkedStorage) -> None:
        """Let go of what held the parked bytes."""


class HostParking(Parking):
    """Host memory: buffers from `pool` when given (pinned, reused), otherwise fresh ones freed at reload."""

    location = "host"

    def __init__(self, pool: HostBufferPool | None, non_blocking: bool) -> None:
        self._pool = pool
        self._non_blocking = non_blocking

    def _store(self, storage: torch.UntypedStorage, parked: ParkedStorage) -> None:
        host = self._pool.take(parked.nbytes) if self._pool else torch.empty(parked.nbytes, dtype=torch.uint8)
        host.copy_(storage_bytes(storage), non_blocking=self._non_blocking)
        parked.host = host
        _point(parked.views, host.untyped_storage(), parked.device)

    def _load(self, parked: ParkedStorage, destination: torch.Tensor) -> None:
        destination.copy_(parked.host, non_blocking=self._non_blocking)

    def _release(self, parked: ParkedStorage) -> None:
        if self._pool is not None and parked.host is not None:
            self._pool.give(parked.host)
        parked.host = None


class DiskParking(Parking):
    """A spill file: tensors hold empty placeholders while their bytes are on disk."""

    location = "nvme"

    def __init__(self, file: SpillFile) -> None:
        self.file = file

    def _store(self, storage: torch.UntypedStorage, parked: ParkedStorage) -> None:
        parked.file_offset = self.file.write(storage_bytes(storage))
        _point(parked.views, None, parked.device)

    def _load(self, parked: ParkedStorage, destination: torch.Tensor) -> None:
        self.file.read_into(parked.file_offset, destination)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, when it is glibc (the only one with malloc_trim)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def trim_host_heap() -> None:
    """Give memory freed by the C allocator back to the system, so freed host storages leave the process's RSS.

    Without it glibc keeps freed blocks below its (adaptive) mmap threshold in the heap for reuse.
    """
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
