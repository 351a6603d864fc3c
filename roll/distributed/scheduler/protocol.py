"""``DataProto``: the batch contract that crosses every Ray boundary in roll.

A ``DataProto`` holds tensors sharing a leading batch dimension (``batch``), per-sample numpy arrays
with the same leading dimension (``non_tensor_batch``) and a free-form ``meta_info`` dict. Methods
never mutate their inputs (except ``pop``); every derived ``DataProto`` gets a shallow copy of
``meta_info``.

Pickling (and therefore ``ray.put``/``ray.get``) ships tensors as contiguous numpy arrays, so pickle
protocol 5 moves their payload out-of-band instead of pickling it element by element.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# numpy has no bfloat16/float8: such tensors travel reinterpreted as an integer dtype of equal width.
_INT_DTYPE_BY_ITEMSIZE: dict[int, torch.dtype] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}

Keys = str | Iterable[str]
Index = int | slice | Sequence[int] | Sequence[bool] | np.ndarray | torch.Tensor


def _key_list(keys: Keys) -> list[str]:
    """Normalise a single key or an iterable of keys to a list."""
    return [keys] if isinstance(keys, str) else list(keys)


def _select_keys(kind: str, source: dict[str, Any], keys: Keys | None) -> dict[str, Any]:
    """Restrict ``source`` to ``keys`` (all when None); unknown keys raise ``ValueError``."""
    if keys is None:
        return dict(source)
    wanted = _key_list(keys)
    missing = [key for key in wanted if key not in source]
    if missing:
        raise ValueError(f"DataProto has no {kind} keys {missing}; available: {sorted(source)}")
    return {key: source[key] for key in wanted}


def _to_object_array(values: list[Any]) -> np.ndarray:
    """Build a 1-D object array element-wise so that lists of lists stay one object per row."""
    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        array[i] = value
    return array


def _values_equal(a: Any, b: Any) -> bool:
    """Compare values that may be tensors, numpy arrays or plain Python objects."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        both = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return both and a.shape == b.shape and torch.equal(a, b.to(a.device))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    return bool(a == b)


def _tensor_to_numpy(tensor: torch.Tensor) -> tuple[np.ndarray, torch.dtype | None]:
    """Contiguous CPU numpy view of ``tensor`` and the dtype to restore (None if numpy holds it)."""
    tensor = tensor.detach().cpu().contiguous()
    try:
        return tensor.numpy(), None
    except TypeError:  # bfloat16, float8, ...: ship the raw bits
        return tensor.view(_INT_DTYPE_BY_ITEMSIZE[tensor.element_size()]).numpy(), tensor.dtype


def _tensor_from_numpy(array: np.ndarray, dtype: torch.dtype | None) -> torch.Tensor:
    """Inverse of ``_tensor_to_numpy``; read-only buffers (Ray's object store) are copied once."""
    tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
    return tensor if dtype is None else tensor.view(dtype)


@dataclass(eq=False)
class DataProto:
    """Tensors and per-sample numpy arrays sharing a leading batch dimension, plus ``meta_info``.

    Lists given as ``non_tensor_batch`` values are converted to 1-D object arrays.
    """

    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.batch = dict(self.batch)
        self.non_tensor_batch = {
            key: _to_object_array(value) if isinstance(value, list) else value
            for key, value in self.non_tensor_batch.items()
        }
        self.meta_info = dict(self.meta_info)
        for name, values, kind in (
            ("batch", self.batch, torch.Tensor),
            ("non_tensor_batch", self.non_tensor_batch, np.ndarray),
        ):
            for key, value in values.items():
                if not isinstance(value, kind) or value.ndim == 0:
                    raise TypeError(
                        f"DataProto.{name}[{key!r}] must be a {kind.__name__} with a batch dimension, "
                        f"got {type(value).__name__} of shape {getattr(value, 'shape', None)}"
                    )
        overlap = self.batch.keys() & self.non_tensor_batch.keys()
        if overlap:
            raise ValueError(f"DataProto keys {sorted(overlap)} are in both batch and non_tensor_batch")
        sizes = {key: value.shape[0] for key, value in (*self.batch.items(), *self.non_tensor_batch.items())}
        if len(set(sizes.values())) > 1:
            detail = ", ".join(f"{key}={size}" for key, size in sizes.items())
            raise ValueError(f"DataProto batch sizes differ: {detail}")

    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, np.ndarray | list[Any]] | None = None,
        meta_info: dict[str, Any] | None = None,
    ) -> DataProto:
        """Build a DataProto from optional tensor, non-tensor and meta_info dicts."""
        return cls(tensors or {}, non_tensors or {}, meta_info or {})

    def __len__(self) -> int:
        """Batch size (0 when there are no tensors and no non-tensor arrays)."""
        first = next(iter((*self.batch.values(), *self.non_tensor_batch.values())), None)
        return 0 if first is None else int(first.shape[0])

    def _index(self, index: slice | np.ndarray) -> DataProto:
        """Apply one row selection (a slice or int64 positions) to every field."""
        tensor_index = index if isinstance(index, slice) else torch.from_numpy(index)
        return DataProto(
            {key: value[tensor_index] for key, value in self.batch.items()},
            {key: value[index] for key, value in self.non_tensor_batch.items()},
            self.meta_info,
        )

    def __getitem__(self, item: Index) -> DataProto:
        """Select rows by int (kept as a length-1 batch), slice, index sequence or boolean mask."""
        size = len(self)
        if isinstance(item, int | np.integer):
            if not -size <= item < size:
                raise IndexError(f"DataProto index {item} out of range for length {size}")
            row = int(item) % size
            return self._index(slice(row, row + 1))
        if isinstance(item, slice):  # torch has no negative-step slices: fall back to positions
            return self._index(item if (item.step or 1) > 0 else np.arange(*item.indices(size)))
        index = np.asarray(item.cpu() if isinstance(item, torch.Tensor) else item)
        if index.dtype == np.bool_:
            if index.shape != (size,):
                raise IndexError(f"DataProto boolean mask of shape {index.shape} does not match length {size}")
            return self._index(np.flatnonzero(index))
        if index.size == 0:
            return self._index(np.zeros(0, dtype=np.int64))
        if index.ndim != 1 or not np.issubdtype(index.dtype, np.integer):
            raise TypeError(f"DataProto cannot be indexed by {type(item).__name__} of dtype {index.dtype}")
        return self._index(index.astype(np.int64))

    def select(
        self,
        batch_keys: Keys | None = None,
        non_tensor_keys: Keys | None = None,
        meta_info_keys: Keys | None = None,
    ) -> DataProto:
        """Keep only the given keys (None keeps all of that kind); unknown keys raise ``ValueError``."""
        return DataProto(
            _select_keys("batch", self.batch, batch_keys),
            _select_keys("non_tensor_batch", self.non_tensor_batch, non_tensor_keys),
            _select_keys("meta_info", self.meta_info, meta_info_keys),
        )

    def pop(
        self,
        batch_keys: Keys | None = None,
        non_tensor_keys: Keys | None = None,
        meta_info_keys: Keys | None = None,
    ) -> DataProto:
        """Remove the given keys from self and return them (None pops nothing of that kind).

        It takes `select`'s parameters on purpose: a pop is a select that also removes.
        """
        popped = self.select(batch_keys or [], non_tensor_keys or [], meta_info_keys or [])
        for source, keys in (
            (self.batch, popped.batch),
            (self.non_tensor_batch, popped.non_tensor_batch),
            (self.meta_info, popped.meta_info),
        ):
            for key in keys:
                del source[key]
        return popped

    def union(self, other: DataProto) -> DataProto:
        """Merge with ``other`` into a new DataProto; keys present in both must hold equal values."""
        merged: list[dict[str, Any]] = []
        for kind, mine, theirs in (
            ("batch", self.batch, other.batch),
            ("non_tensor_batch", self.non_tensor_batch, other.non_tensor_batch),
            ("meta_info", self.meta_info, other.meta_info),
        ):
            out = dict(mine)
            for key, value in theirs.items():
                if key in out and not _values_equal(out[key], value):
                    raise ValueError(f"DataProto.union: {kind} key {key!r} differs between the two sides")
                out.setdefault(key, value)
            merged.append(out)
        return DataProto(*merged)  # the constructor rejects mismatched batch sizes

    def rename(self, old_keys: Keys, new_keys: Keys) -> DataProto:
        """Return a DataProto whose tensor / non-tensor keys ``old_keys[i]`` are named ``new_keys[i]``."""
        old, new = _key_list(old_keys), _key_list(new_keys)
        if len(old) != len(new):
            raise ValueError(f"DataProto.rename got {len(old)} old keys but {len(new)} new keys")
        _select_keys("batch/non_tensor_batch", {**self.batch, **self.non_tensor_batch}, old)
        mapping = dict(zip(old, new, strict=True))
        batch = {mapping.get(key, key): value for key, value in self.batch.items()}
        non_tensor = {mapping.get(key, key): value for key, value in self.non_tensor_batch.items()}
        if len(batch) != len(self.batch) or len(non_tensor) != len(self.non_tensor_batch):
            raise ValueError(f"DataProto.rename {mapping} would merge two keys into one")
        return DataProto(batch, non_tensor, self.meta_info)

    def chunk(self, n: int) -> list[DataProto]:
        """Split into ``n`` equal parts; the length must be divisible by ``n``."""
        if n < 1:
            raise ValueError(f"DataProto.chunk needs n >= 1, got {n}")
        if len(self) % n:
            raise ValueError(
                f"DataProto of length {len(self)} cannot be chunked into {n} equal parts; use pad_to_divisor({n}) first"
            )
        size = len(self) // n
        return [self._index(slice(i * size, (i + 1) * size)) for i in range(n)]

    def split(self, size: int) -> list[DataProto]:
        """Split into pieces of ``size`` rows; the last piece may be smaller."""
        if size < 1:
            raise ValueError(f"DataProto.split needs size >= 1, got {size}")
        return [self._index(slice(start, start + size)) for start in range(0, len(self), size)]

    @classmethod
    def concat(cls, parts: Sequence[DataProto]) -> DataProto:
        """Concatenate along the batch dimension; key sets must match, meta_info comes from the first."""
        if not parts:
            raise ValueError("DataProto.concat needs at least one part")
        first = parts[0]
        for i, part in enumerate(parts[1:], start=1):
            for kind, a, b in (
                ("batch", first.batch, part.batch),
                ("non_tensor_batch", first.non_tensor_batch, part.non_tensor_batch),
            ):
                if a.keys() != b.keys():
                    raise ValueError(
                        f"DataProto.concat: {kind} keys differ between part 0 and part {i}: only in part 0 "
                        f"{sorted(a.keys() - b.keys())}, only in part {i} {sorted(b.keys() - a.keys())}"
                    )
        return cls(
            {key: torch.cat([part.batch[key] for part in parts]) for key in first.batch},
            {key: np.concatenate([part.non_tensor_batch[key] for part in parts]) for key in first.non_tensor_batch},
            first.meta_info,
        )

    def repeat(self, times: int, interleave: bool = True) -> DataProto:
        """Repeat rows ``times`` times: interleaved ``a,a,b,b`` or, with ``interleave=False``, ``a,b,a,b``."""
        rows = np.arange(len(self))
        return self._index(np.repeat(rows, times) if interleave else np.tile(rows, times))

    def pad_to_divisor(self, divisor: int) -> tuple[DataProto, int]:
        """Pad by cycling rows from the start until the length is divisible; return (padded, pad_size)."""
        if divisor < 1:
            raise ValueError(f"DataProto.pad_to_divisor needs divisor >= 1, got {divisor}")
        pad_size = -len(self) % divisor
        index = np.arange(len(self) + pad_size) % len(self) if pad_size else slice(None)
        return self._index(index), pad_size

    def unpad(self, pad_size: int) -> DataProto:
        """Drop the last ``pad_size`` rows (undoes ``pad_to_divisor``)."""
        if not 0 <= pad_size <= len(self):
            raise ValueError(f"DataProto.unpad: pad_size {pad_size} not in [0, {len(self)}]")
        return self._index(slice(0, len(self) - pad_size))

    def to(self, device: str | torch.device) -> DataProto:
        """Return a DataProto with every tensor moved to ``device``."""
        return DataProto(
            {key: value.to(device) for key, value in self.batch.items()},
            self.non_tensor_batch,
            self.meta_info,
        )

    def __getstate__(self) -> dict[str, Any]:
        """Pickle tensors as contiguous numpy arrays so protocol 5 ships them out-of-band."""
        return {
            "batch": {key: _tensor_to_numpy(value) for key, value in self.batch.items()},
            "non_tensor_batch": self.non_tensor_batch,
            "meta_info": self.meta_info,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild CPU tensors, restoring reinterpreted dtypes such as bfloat16."""
        self.batch = {key: _tensor_from_numpy(array, dtype) for key, (array, dtype) in state["batch"].items()}
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]
