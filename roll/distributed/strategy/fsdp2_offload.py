"""Phase offloading for fsdp2_train: each state storage's bytes leave for host memory or a spill file, and the storage
is resized to nothing in place; reloading resizes it back and copies the bytes in.

Resizing the storage itself, as FSDP2 frees its unsharded parameters, keeps every tensor that views it valid:
the DTensor shards, FSDP2's own padded flat buffers and the optimizer's states need no repointing, so nothing
here depends on FSDP2's internals. The bytes come back exactly as they left.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from roll.third_party.deepspeed.spill_file import SpillFile
from roll.third_party.deepspeed.storage_mover import storage_bytes, trim_host_heap

STAGING_BYTES = 64 << 20  # host chunk that the bytes pass through on their way to and from disk


@dataclass
class _Parked:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None = None
    file_offset: int = -1


class StateOffloader:
    """The offloaded storages of one strategy's states, by kind, and the spill file holding them on disk."""

    def __init__(self) -> None:
        self.parked: dict[str, list[_Parked]] = {}
        self.file: SpillFile | None = None
        self._staging: torch.Tensor | None = None

    def offload(self, states: dict[str, list[torch.Tensor]], device: str, nvme_dir: str = "") -> dict[str, float]:
        """Move the storages of `states` (tensors by kind) to `device` ("cpu": host memory, taking only storages on an
        accelerator; "nvme": a spill file under `nvme_dir`, host storages too); kinds already offloaded stay.
        Returns DeepSpeed's offload metrics: bytes moved per kind and the seconds taken."""
        start = time.perf_counter()
        moved = dict.fromkeys(states, 0)
        seen = {parked.storage.data_ptr() for kind in self.parked.values() for parked in kind}
        for kind, tensors in states.items():
            if kind in self.parked:
                continue
            self.parked[kind] = []
            for tensor in tensors:
                storage = tensor.untyped_storage()
                movable = device == "nvme" or storage.device.type != "cpu"
                if not movable or storage.nbytes() == 0 or storage.data_ptr() in seen or not storage.resizable():
                    continue
                seen.add(storage.data_ptr())
                self.parked[kind].append(self._park(storage, device, nvme_dir))
                moved[kind] += self.parked[kind][-1].nbytes
        trim_host_heap()
        return _metrics("offload", moved, start)

    def reload(self, kinds: set[str] | None = None) -> dict[str, float]:
        """Bring the offloaded storages of `kinds` (all when None) back, bit for bit, into the storages they left; close
        the spill file once nothing is left on it."""
        start = time.perf_counter()
        moved = {kind: 0 for kind in self.parked if kinds is None or kind in kinds}
        for kind in moved:
            storages = self.parked.pop(kind)
            while storages:
                parked = storages.pop()
                parked.storage.resize_(parked.nbytes)
                destination = storage_bytes(parked.storage)
                if parked.host is not None:
                    destination.copy_(parked.host)
                else:
                    self._read(parked.file_offset, destination)
                moved[kind] += parked.nbytes
        if not self.parked:
            self.close()
        return _metrics("reload", moved, start)

    def close(self) -> None:
        """Close the spill file (its blocks are freed); closing twice is harmless."""
        if self.file is not None:
            self.file.close()
            self.file = None

    def _park(self, storage: torch.UntypedStorage, device: str, nvme_dir: str) -> _Parked:
        parked = _Parked(storage, storage.nbytes())
        source = storage_bytes(storage)
        if device == "nvme":
            if self.file is None:
                self.file = SpillFile(nvme_dir, self._staging_buffer)
            parked.file_offset = self._write(source)
        else:
            accelerator = storage.device.type != "cpu"
            parked.host = torch.empty(parked.nbytes, dtype=torch.uint8, pin_memory=accelerator).copy_(source)
        del source
        storage.resize_(0)
        return parked

    # Through a staging chunk both ways: SpillFile reads and writes a host tensor through numpy, and a storage once
    # exported to numpy can no longer be resized.
    def _write(self, source: torch.Tensor) -> int:
        staging, offset = self._staging_buffer(), -1
        for start in range(0, source.numel(), staging.numel()):
            chunk = source[start : start + staging.numel()]
            staging[: chunk.numel()].copy_(chunk)
            written = self.file.write(staging[: chunk.numel()])
            offset = written if offset < 0 else offset
        return offset

    def _read(self, offset: int, destination: torch.Tensor) -> None:
        staging = self._staging_buffer()
        for start in range(0, destination.numel(), staging.numel()):
            chunk = destination[start : start + staging.numel()]
            self.file.read_into(offset + start, staging[: chunk.numel()])
            chunk.copy_(staging[: chunk.numel()])

    def _staging_buffer(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return self._staging


def _metrics(action: str, moved: dict[str, int], start: float) -> dict[str, float]:
    metrics = {f"offload_states/{action}/moved_bytes/{kind}": float(n) for kind, n in moved.items()}
    metrics[f"offload_states/{action}/seconds"] = time.perf_counter() - start
    return metrics
