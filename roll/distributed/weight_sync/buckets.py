"""Weight buckets: groups of `(Hugging Face name, tensor)` pairs of about a configured size.

A bucket travels either as its tensors one by one (over a broadcast group, described by its specs)
or packed into one flat byte buffer (handed over on a node), whose views unpack it without a copy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from roll.utils.grouping import iter_groups

NamedTensors = list[tuple[str, torch.Tensor]]
# Offsets in a flat bucket are multiples of this, so every dtype can be viewed in place.
_ALIGN = 64


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements."""
    return tensor.numel() * tensor.element_size()


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[NamedTensors]:
    """Consecutive buckets of at least `bucket_bytes` (the last may be smaller)."""
    return iter_groups(named_tensors, bucket_bytes, lambda item: tensor_bytes(item[1]))


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver needs to allocate a tensor before its bytes arrive."""

    name: str
    dtype: str  # torch dtype name without the module, e.g. "bfloat16"
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype as a torch.dtype."""
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's elements."""
        return math.prod(self.shape) * self.torch_dtype.itemsize

    def to_json(self) -> list:
        """A JSON-able form (`[name, dtype, shape]`)."""
        return [self.name, self.dtype, list(self.shape)]

    @classmethod
    def from_json(cls, value: list) -> TensorSpec:
        """Inverse of `to_json`."""
        name, dtype, shape = value
        return cls(name, dtype, tuple(shape))


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    """The spec of one named tensor."""
    return TensorSpec(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


def pack_flat(bucket: NamedTensors) -> tuple[torch.Tensor, list[TensorSpec]]:
    """The bucket's bytes in one uint8 buffer on its tensors' device, and the specs that unpack it."""
    specs = [spec_of(name, tensor) for name, tensor in bucket]
    offsets = _offsets(specs)
    device = bucket[0][1].device if bucket else torch.device("cpu")
    flat = torch.empty(offsets[-1], dtype=torch.uint8, device=device)
    for (_, tensor), start in zip(bucket, offsets, strict=False):
        flat[start : start + tensor_bytes(tensor)].copy_(tensor.contiguous().reshape(-1).view(torch.uint8))
    return flat, specs


def unpack_flat(flat: torch.Tensor, specs: list[TensorSpec]) -> NamedTensors:
    """Views of `flat` as the named tensors `pack_flat` put in it (no copy)."""
    offsets = _offsets(specs)
    named: NamedTensors = []
    for spec, start in zip(specs, offsets, strict=False):
        dtype = spec.torch_dtype
        raw = flat[start : start + spec.nbytes]
        named.append((spec.name, raw.view(dtype).reshape(spec.shape)))
    return named


def _offsets(specs: list[TensorSpec]) -> list[int]:
    """Start of each tensor in the flat buffer, then the buffer's total size."""
    offsets, position = [], 0
    for spec in specs:
        offsets.append(position)
        position += math.ceil(spec.nbytes / _ALIGN) * _ALIGN
    return [*offsets, position]
