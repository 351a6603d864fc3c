"""Unnamed files under a directory that hold offloaded bytes on disk."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Callable

import torch


class SpillFile:
    """A file under `directory` that offloaded storages are appended to, and read back from.

    The file never has a name in the directory (O_TMPFILE, or unlinked right after it is created where the filesystem
    lacks O_TMPFILE), so its blocks are freed when it is closed: at reload, when the engine is garbage collected, at
    exit, and when the process dies for any reason. Writes go through the page cache without fsync: the process's
    memory is freed at once, and the kernel writes the pages back and evicts them under memory pressure.
    Device tensors pass through `staging()`, a pinned host buffer, one chunk at a time.
    """

    def __init__(self, directory: str | os.PathLike[str], staging: Callable[[], torch.Tensor]) -> None:
        os.makedirs(directory, exist_ok=True)
        self._fd = _open_unnamed(os.fspath(directory))
        self._end = 0
        self._staging = staging

    def write(self, data: torch.Tensor) -> int:
        """Append a uint8 tensor's bytes; returns their offset in the file."""
        offset = self._end
        if data.device.type == "cpu":
            _write_all(self._fd, memoryview(data.numpy()), offset)
        else:
            staging = self._staging()
            for start in range(0, data.numel(), staging.numel()):
                chunk = data[start : start + staging.numel()]
                staging[: chunk.numel()].copy_(chunk)
                _write_all(self._fd, memoryview(staging[: chunk.numel()].numpy()), offset + start)
        self._end += data.numel()
        return offset

    def read_into(self, offset: int, destination: torch.Tensor) -> None:
        """Fill a uint8 tensor with the bytes written at `offset`."""
        if destination.device.type == "cpu":
            _read_all(self._fd, memoryview(destination.numpy()), offset)
            return
        staging = self._staging()
        for start in range(0, destination.numel(), staging.numel()):
            chunk = destination[start : start + staging.numel()]
            _read_all(self._fd, memoryview(staging[: chunk.numel()].numpy()), offset + start)
            chunk.copy_(staging[: chunk.numel()])

    def close(self) -> None:
        """Close the file, which frees its blocks; closing twice is harmless."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _open_unnamed(directory: str) -> int:
    """A read-write descriptor of a new file in `directory` that has no name."""
    if hasattr(os, "O_TMPFILE"):
        try:
            return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
    fd, path = tempfile.mkstemp(prefix="roll-offload-", dir=directory)
    os.unlink(path)
    return fd


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    """pwrite until every byte is written (one call moves at most about 2 GiB on Linux)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _read_all(fd: int, buffer: memoryview, offset: int) -> None:
    """pread until `buffer` is full."""
    done = 0
    while done < len(buffer):
        read = os.preadv(fd, [buffer[done:]], offset + done)
        if read == 0:
            raise OSError(errno.EIO, f"spill file ended at byte {offset + done}, expected {offset + len(buffer)}")
        done += read
