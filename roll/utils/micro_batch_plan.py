"""Which rows run together in one forward pass when micro-batches are formed by a token budget.

Rows are described by the real (attended) tokens of their prompt and of their response. A padded
micro-batch keeps the prompt|response layout trimmed to its longest real prompt and longest real
response, so it costs `rows x (longest prompt + longest response)` tokens; a packed micro-batch
concatenates its sequences into one row and costs the sum of their lengths.
"""

from __future__ import annotations

from collections.abc import Sequence


def padded_cost(prompt_lengths: Sequence[int], response_lengths: Sequence[int], rows: Sequence[int]) -> int:
    """Tokens of `rows` laid out as one padded micro-batch (longest prompt + longest response per row)."""
    return len(rows) * (max(prompt_lengths[i] for i in rows) + max(response_lengths[i] for i in rows))


def plan_by_token_budget(
    prompt_lengths: Sequence[int], response_lengths: Sequence[int], max_tokens: int, packed: bool
) -> list[list[int]]:
    """Groups of row indices, each within `max_tokens`, longest sequences first; rows ascending within a group.

    Padded: rows sorted by length are cut into consecutive groups (similar lengths share a group, so
    little padding remains). Packed: first-fit decreasing on the sum of lengths. A row longer than
    the budget is a ValueError (the config check keeps the budget above the longest possible row).
    """
    lengths = [p + r for p, r in zip(prompt_lengths, response_lengths, strict=True)]
    too_long = [i for i, length in enumerate(lengths) if length > max_tokens]
    if too_long:
        raise ValueError(
            f"row {too_long[0]} has {lengths[too_long[0]]} real tokens, more than the budget of {max_tokens}"
        )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    if packed:
        loads: list[int] = []
        for i in order:
            fits = next((g for g, load in enumerate(loads) if load + lengths[i] <= max_tokens), None)
            if fits is None:
                groups.append([i])
                loads.append(lengths[i])
            else:
                groups[fits].append(i)
                loads[fits] += lengths[i]
    else:
        for i in order:
            if groups and padded_cost(prompt_lengths, response_lengths, [*groups[-1], i]) <= max_tokens:
                groups[-1].append(i)
            else:
                groups.append([i])
    return [sorted(group) for group in groups]


def split_to_count(groups: list[list[int]], count: int) -> list[list[int]]:
    """`groups` with the group of most rows halved until there are `count` of them (every group stays non-empty).

    Data-parallel ranks that must run the same number of forward passes (ZeRO-3 gathers parameters in
    each) raise their plans to the largest count this way; halving a group never breaks its budget.
    """
    groups = [list(group) for group in groups]
    while len(groups) < count:
        largest = max(range(len(groups)), key=lambda g: len(groups[g]))
        group = groups[largest]
        if len(group) < 2:
            raise ValueError(f"{sum(map(len, groups))} rows cannot form {count} non-empty micro-batches")
        groups[largest : largest + 1] = [group[: len(group) // 2], group[len(group) // 2 :]]
    return groups
