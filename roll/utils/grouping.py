"""Cutting a stream into groups of about a given size (weight buckets, ZeRO-3 gather groups)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def iter_groups(items: Iterable[T], limit: int, size_of: Callable[[T], int]) -> Iterator[list[T]]:
    """Consecutive groups whose sizes reach `limit` (the last may be smaller; a larger item is a group alone)."""
    if limit < 1:
        raise ValueError(f"a group size limit must be positive, got {limit}")
    group: list[T] = []
    size = 0
    for item in items:
        group.append(item)
        size += size_of(item)
        if size >= limit:
            yield group
            group, size = [], 0
    if group:
        yield group
