"""Offload every state of a DeepSpeed engine between phases, and back, with nothing lost.

`patch_engine(engine)` binds `offload_states` and `reload_states` onto a DeepSpeed engine of any ZeRO stage (0-3),
with or without an optimizer, frozen parameters included. States move by storage (see `storage_mover`) to host
memory or to unnamed files on disk, and every call returns an `OffloadReport`. `offload_phase` wraps a phase: it
reloads what the phase needs and offloads it again afterwards. docs/offload.md says what moves at each stage.
"""

from __future__ import annotations

import gc
import logging
import time
import types
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from deepspeed.accelerator import get_accelerator

from roll.third_party.deepspeed.spill_file import SpillFile
from roll.third_party.deepspeed.state_fields import (
    MODEL,
    RELEASE_GATHERED_PARAMS,
    OffloadStateType,
    UnsupportedDeepSpeedError,
    check_supported,
    collect_storage_groups,
)
from roll.third_party.deepspeed.storage_mover import (
    DiskParking,
    HostBufferPool,
    HostParking,
    ParkedStorage,
    Parking,
    StorageGroup,
    storage_use_count,
    trim_host_heap,
)

__all__ = ["OffloadReport", "OffloadStateType", "UnsupportedDeepSpeedError", "offload_phase", "patch_engine"]

logger = logging.getLogger(__name__)

StateTypes = OffloadStateType | str | Iterable[OffloadStateType | str] | None

OFFLOAD_DEVICES = ("cpu", "nvme")
STAGING_BYTES = 64 << 20  # pinned chunk that device tensors pass through on their way to and from disk
_OFFLOADER_ATTR = "_roll_offloader"


@dataclass
class OffloadReport:
    """What one `offload_states` or `reload_states` call did.

    `moved_bytes` counts the bytes copied per state kind; `scratch_bytes` the gradient buckets freed (offload) or
    reallocated (reload) without a copy; `resident_bytes` all state bytes after the call, per location: the device
    (`cuda:0`, or `cpu` on CPU-only machines), `host` (offloaded to host memory) and `nvme` (offloaded to disk).
    `stale_bytes` are offloaded bytes whose old storage something outside the fields in `state_fields` still holds:
    that memory is not freed. It is 0 unless DeepSpeed changed its internals.
    """

    action: str
    moved_bytes: dict[str, int]
    scratch_bytes: int
    resident_bytes: dict[str, int]
    stale_bytes: int
    seconds: float

    def as_metrics(self, prefix: str = "offload_states") -> dict[str, float]:
        """Flat metric names, e.g. `offload_states/offload/moved_bytes/model_params`."""
        head = f"{prefix}/{self.action}"
        metrics = {
            f"{head}/seconds": self.seconds,
            f"{head}/scratch_bytes": float(self.scratch_bytes),
            f"{head}/stale_bytes": float(self.stale_bytes),
        }
        metrics.update({f"{head}/moved_bytes/{kind}": float(n) for kind, n in self.moved_bytes.items()})
        metrics.update({f"{head}/resident_bytes/{where}": float(n) for where, n in self.resident_bytes.items()})
        return metrics


@dataclass
class _ParkedKind:
    """The storages of one offloaded state kind and the place holding them."""

    parking: Parking
    storages: list[ParkedStorage]

    def host_pointers(self) -> set[int]:
        """Data pointers of the host buffers holding this kind."""
        return {stored.host.data_ptr() for stored in self.storages if stored.host is not None}


class _EngineOffloader:
    """The offloaded states of one engine, and the pinned buffers and spill files kept for them."""

    def __init__(self) -> None:
        self.parked: dict[OffloadStateType, _ParkedKind] = {}
        self._pools: dict[OffloadStateType, HostBufferPool] = {}
        self._staging: torch.Tensor | None = None

    def offload(
        self,
        engine: Any,
        kinds: list[OffloadStateType],
        device: str,
        pin_memory: bool,
        non_blocking: bool,
        nvme_dir: str | None,
    ) -> OffloadReport:
        """Park the kinds not parked yet; see `_offload_states`."""
        start = time.perf_counter()
        todo = [kind for kind in kinds if kind not in self.parked]
        moved = dict.fromkeys((kind.value for kind in kinds), 0)
        scratch = stale = 0
        if todo:
            if MODEL in todo and hasattr(engine.optimizer, RELEASE_GATHERED_PARAMS):
                getattr(engine.optimizer, RELEASE_GATHERED_PARAMS)()
            device_type = get_accelerator().device_name()
            groups = collect_storage_groups(engine)
            movable = {
                kind: [g for g in groups[kind] if device == "nvme" or g.storage.device.type == device_type]
                for kind in todo
            }
            del groups
            try:
                for kind in todo:
                    storages = self._park_kind(kind, movable[kind], device, pin_memory, non_blocking, nvme_dir)
                    moved[kind.value] = sum(stored.nbytes for stored in storages if not stored.scratch)
                    scratch += sum(stored.nbytes for stored in storages if stored.scratch)
            except BaseException:
                # All or nothing: kinds parked earlier in this call come back before the error propagates.
                movable.clear()
                self.reload(engine, [kind for kind in todo if kind in self.parked], non_blocking=False)
                raise
            stale = _stale_bytes(movable)
            if stale:  # perhaps only garbage cycles still hold them: a full collection is slow, so only then
                gc.collect()
                stale = _stale_bytes(movable)
            del movable
            if stale:
                logger.warning(
                    "%d offloaded bytes are still referenced outside the DeepSpeed fields roll knows; their memory "
                    "is not freed, and writes through those references are lost at reload",
                    stale,
                )
            get_accelerator().empty_cache()
            trim_host_heap()
        if not non_blocking:
            get_accelerator().synchronize()
        return self._report(engine, "offload", moved, scratch, stale, start)

    def reload(self, engine: Any, kinds: list[OffloadStateType], non_blocking: bool) -> OffloadReport:
        """Restore the parked kinds among `kinds`; see `_reload_states`."""
        start = time.perf_counter()
        moved = dict.fromkeys((kind.value for kind in kinds), 0)
        scratch = 0
        for kind in kinds:
            parked = self.parked.get(kind)
            if parked is None:
                continue
            # Restored one by one and dropped from the record as they land: after an error (e.g. out of device
            # memory) the rest stays parked and a second reload finishes the job.
            while parked.storages:
                stored = parked.storages[-1]
                parked.parking.restore(stored)
                parked.storages.pop()
                if stored.scratch:
                    scratch += stored.nbytes
                else:
                    moved[kind.value] += stored.nbytes
            if isinstance(parked.parking, DiskParking):
                parked.parking.file.close()
            del self.parked[kind]
        if not non_blocking:
            get_accelerator().synchronize()
        return self._report(engine, "reload", moved, scratch, 0, start)

    def _park_kind(
        self,
        kind: OffloadStateType,
        groups: list[StorageGroup],
        device: str,
        pin_memory: bool,
        non_blocking: bool,
        nvme_dir: str | None,
    ) -> list[ParkedStorage]:
        """Park the storages of one kind and record them."""
        parking = self._parking(kind, device, pin_memory, non_blocking, nvme_dir)
        try:
            storages = parking.park_all(groups)
        except BaseException:
            if isinstance(parking, DiskParking):
                parking.file.close()
            raise
        self.parked[kind] = _ParkedKind(parking, storages)
        if kind in self._pools:
            self._pools[kind].drop_free()
        return storages

    def close(self) -> None:
        """Close the spill files of states still on disk (the engine is gone or the process exits)."""
        for parked in self.parked.values():
            if isinstance(parked.parking, DiskParking):
                parked.parking.file.close()

    def _parking(
        self, kind: OffloadStateType, device: str, pin_memory: bool, non_blocking: bool, nvme_dir: str | None
    ) -> Parking:
        """Where `kind` goes: a spill file, reused pinned buffers (accelerators), or fresh host buffers."""
        if device == "nvme":
            return DiskParking(SpillFile(nvme_dir, self._staging_buffer))
        if not pin_memory or get_accelerator().device_name() == "cpu":
            self._pools.pop(kind, None)
            return HostParking(None, non_blocking)
        pool = self._pools.setdefault(kind, HostBufferPool(_pinned_empty))
        return HostParking(pool, non_blocking)

    def _staging_buffer(self) -> torch.Tensor:
        """The pinned chunk device tensors are copied through on their way to and from disk."""
        if self._staging is None:
            self._staging = _pinned_empty(STAGING_BYTES)
        return self._staging

    def _report(
        self, engine: Any, action: str, moved: dict[str, int], scratch: int, stale: int, start: float
    ) -> OffloadReport:
        """Count the resident bytes and time the call."""
        resident: dict[str, int] = defaultdict(int)
        for kind, groups in collect_storage_groups(engine).items():
            hosted = self.parked[kind].host_pointers() if kind in self.parked else set()
            for group in groups:
                where = "host" if group.storage.data_ptr() in hosted else str(group.storage.device)
                resident[where] += group.nbytes
        for parked in self.parked.values():
            if isinstance(parked.parking, DiskParking):
                resident["nvme"] += sum(stored.nbytes for stored in parked.storages if not stored.scratch)
        report = OffloadReport(action, moved, scratch, dict(resident), stale, time.perf_counter() - start)
        logger.debug("%s: %s", action, report)
        return report


def _stale_bytes(released: dict[OffloadStateType, list[StorageGroup]]) -> int:
    """Bytes of released storages that something besides their group's handle still references."""
    return sum(group.nbytes for groups in released.values() for group in groups if storage_use_count(group.storage) > 1)


def _pinned_empty(nbytes: int) -> torch.Tensor:
    """A page-locked uint8 host buffer."""
    return get_accelerator().pin_memory(torch.empty(nbytes, dtype=torch.uint8))


def _state_types(include: StateTypes) -> list[OffloadStateType]:
    """`include` as a list of state kinds; None means all of them."""
    if include is None:
        return list(OffloadStateType)
    if isinstance(include, (str, OffloadStateType)):
        include = [include]
    kinds = []
    for name in include:
        try:
            kind = OffloadStateType(getattr(name, "value", name))
        except ValueError:
            valid = ", ".join(kind.value for kind in OffloadStateType)
            raise ValueError(f"unknown engine state {name!r}; valid states: {valid}") from None
        if kind not in kinds:
            kinds.append(kind)
    return kinds


def _offload_states(
    self: Any,
    include: StateTypes = None,
    device: str = "cpu",
    pin_memory: bool = True,
    non_blocking: bool = False,
    nvme_dir: str | None = None,
) -> OffloadReport:
    """Move the `include`d states (all when None) off the device; states already offloaded stay where they are.

    `device` is "cpu" (host memory: reused pinned buffers on accelerators when `pin_memory`, fresh buffers on
    CPU-only machines) or "nvme" (unnamed files under `nvme_dir`; host-resident states such as DeepSpeed's
    CPU-offloaded optimizer move to disk too). With `non_blocking` the device copies are only queued.
    """
    device = str(getattr(device, "value", device))
    if device not in OFFLOAD_DEVICES:
        raise ValueError(f"offload device must be one of {', '.join(OFFLOAD_DEVICES)}, got {device!r}")
    if device == "nvme" and not nvme_dir:
        raise ValueError("offload device 'nvme' needs nvme_dir, the directory for the spill files")
    offloader: _EngineOffloader = getattr(self, _OFFLOADER_ATTR)
    return offloader.offload(self, _state_types(include), device, pin_memory, non_blocking, nvme_dir)


def _reload_states(self: Any, include: StateTypes = None, non_blocking: bool = False) -> OffloadReport:
    """Bring the `include`d states (all when None) back to where they were; resident states are left alone."""
    offloader: _EngineOffloader = getattr(self, _OFFLOADER_ATTR)
    return offloader.reload(self, _state_types(include), non_blocking)


def patch_engine(engine: Any) -> Any:
    """Bind `offload_states` and `reload_states` onto a DeepSpeed engine and return it; patching twice is harmless.

    Raises `UnsupportedDeepSpeedError` for a DeepSpeed version or an engine configuration offloading cannot handle.
    """
    if isinstance(getattr(engine, _OFFLOADER_ATTR, None), _EngineOffloader):
        return engine
    check_supported(engine)
    offloader = _EngineOffloader()
    setattr(engine, _OFFLOADER_ATTR, offloader)
    weakref.finalize(engine, offloader.close)
    engine.offload_states = types.MethodType(_offload_states, engine)
    engine.reload_states = types.MethodType(_reload_states, engine)
    return engine


@contextmanager
def offload_phase(
    engine: Any,
    needed: StateTypes,
    *,
    device: str = "cpu",
    nvme_dir: str | None = None,
    pin_memory: bool = True,
    non_blocking: bool = False,
) -> Iterator[list[OffloadReport]]:
    """Reload the states a phase needs on entry and offload them again on exit, also when the phase raises.

    Yields the reports (the offload one is appended on exit) so the caller can log them as metrics.
    """
    patch_engine(engine)
    reports = [engine.reload_states(include=needed, non_blocking=non_blocking)]
    try:
        yield reports
    finally:
        reports.append(
            engine.offload_states(
                include=needed, device=device, pin_memory=pin_memory, non_blocking=non_blocking, nvme_dir=nvme_dir
            )
        )
