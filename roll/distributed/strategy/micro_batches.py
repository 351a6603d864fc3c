"""How a batch is cut into micro-batches: fixed row counts, or a token budget with padding trimmed or rows packed.

A batch holds left-padded prompts followed by right-padded responses (`input_ids` = `[prompts | responses]`).
Under a token budget each micro-batch is trimmed to the columns its rows attend, and tensors laid out
along the responses (`responses`, `response_mask`, `advantages`, ...) to the same response columns, so a
loss or forward function sees the usual layout, only narrower. Per-row results are put back in the
batch's row order and width by `restore_rows`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from roll.algorithms.policy_losses import AGG_MODES, AggMode, aggregation_count
from roll.configs.worker_config import WorkerConfig
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.strategy import DATA_PARALLEL_SIZE, MICRO_BATCHES_IN_STEP, STEP_COUNTS
from roll.utils.micro_batch_plan import plan_by_token_budget, split_to_count

# The masks a training loss may normalise over a whole optimizer step (`step_normalised`): the response
# tokens (actor, critic, SFT, distillation) and the process reward model's step ends.
NORMALISED_MASKS = ("response_mask", "step_mask")


@dataclass(frozen=True)
class TokenBudget:
    """Micro-batches of at most `max_tokens` tokens (padding included), or packed rows of that many when `packing`."""

    max_tokens: int
    packing: bool = False
    flash_varlen: bool = False  # packed rows also hand flash-attention its varlen boundaries (GPU)


def token_budget(worker_config: WorkerConfig) -> TokenBudget | None:
    """The role's token budget, or None for fixed-size micro-batches."""
    if worker_config.max_tokens_per_microbatch is None:
        return None
    return TokenBudget(
        max_tokens=worker_config.max_tokens_per_microbatch,
        packing=worker_config.sequence_packing,
        flash_varlen=worker_config.model_args.attn_implementation.startswith("flash_attention"),
    )


@dataclass(frozen=True)
class DataParallel:
    """The data-parallel ranks whose gradients the engine averages: how many, their process group, and the
    device its collectives take tensors on. Tensor-parallel peers hold the same rows and are not in it."""

    size: int = 1
    group: Any = None  # a torch.distributed process group; None: the default group
    device: torch.device | str = "cpu"

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over the group (`values` itself when this rank is the group)."""
        if self.size == 1:
            return values
        summed = values.to(self.device)
        torch.distributed.all_reduce(summed, group=self.group)
        return summed.cpu()


SINGLE_RANK = DataParallel()


@dataclass
class MicroBatch:
    """Rows of a batch that run in one forward pass."""

    data: DataProto
    rows: list[int]  # their positions in the batch they were cut from
    columns: tuple[int, int]  # the sequence columns kept, [start, end) of the batch's width
    response_columns: tuple[int, int]  # the response columns kept, [start, end) of the responses' width
    packed: bool = False  # runs as one row of its sequences concatenated
    flash_varlen: bool = False  # the packed row also hands flash-attention its sequences' boundaries


def _prompt_width(batch: DataProto) -> int:
    responses = batch.batch.get("responses")
    return batch.batch["input_ids"].shape[1] - (0 if responses is None else responses.shape[1])


def _trimmed(batch: DataProto, rows: list[int]) -> MicroBatch:
    """`rows` of `batch` cut to the columns they attend (at least one prompt and one response column kept)."""
    data = batch[rows]
    width, prompt_width = data.batch["input_ids"].shape[1], _prompt_width(data)
    response_width = width - prompt_width
    attended = data.batch["attention_mask"].bool().any(0).nonzero().flatten().tolist()
    start, end = (attended[0], attended[-1] + 1) if attended else (0, width)
    if prompt_width:
        start = min(start, prompt_width - 1)
    if response_width:
        end = max(end, prompt_width + 1)
    response_start, response_end = max(start - prompt_width, 0), end - prompt_width
    tensors = {}
    for key, value in data.batch.items():
        if value.dim() < 2:
            tensors[key] = value
        elif key == "prompts":
            tensors[key] = value[:, min(start, prompt_width) :]
        elif value.shape[1] == width:
            tensors[key] = value[:, start:end]
        elif response_width and value.shape[1] == response_width:
            tensors[key] = value[:, response_start:response_end]
        else:
            tensors[key] = value
    trimmed = DataProto(tensors, data.non_tensor_batch, data.meta_info)
    return MicroBatch(trimmed, list(rows), (start, end), (response_start, response_end))


def real_lengths(batch: DataProto) -> tuple[list[int], list[int]]:
    """Attended prompt tokens and attended response tokens of every row."""
    mask, prompt_width = batch.batch["attention_mask"], _prompt_width(batch)
    return mask[:, :prompt_width].sum(-1).tolist(), mask[:, prompt_width:].sum(-1).tolist()


def plan_micro_batches(
    batch: DataProto,
    micro_batch_size: int,
    budget: TokenBudget | None,
    agree_count: Callable[[int], int] = int,
) -> list[MicroBatch]:
    """Micro-batches covering every row of `batch` once.

    Without a budget: consecutive rows, `micro_batch_size` at a time, untrimmed. With one: rows grouped by
    `plan_by_token_budget` and trimmed; `agree_count` maps this rank's count of micro-batches to the count
    every rank must run (the largest, where ranks step together), reached by halving the largest groups.
    """
    if budget is None:
        width = batch.batch["input_ids"].shape[1]
        whole = (0, width), (0, width - _prompt_width(batch))
        groups = [
            list(range(start, min(start + micro_batch_size, len(batch))))
            for start in range(0, len(batch), micro_batch_size)
        ]
        return [MicroBatch(batch[group[0] : group[-1] + 1], group, *whole) for group in groups]
    prompt_lengths, response_lengths = real_lengths(batch)
    groups = plan_by_token_budget(prompt_lengths, response_lengths, budget.max_tokens, budget.packing)
    groups = split_to_count(groups, agree_count(len(groups)))
    micro_batches = [_trimmed(batch, group) for group in groups]
    for micro_batch in micro_batches:
        micro_batch.packed, micro_batch.flash_varlen = budget.packing, budget.packing and budget.flash_varlen
    return micro_batches


def step_counts(step_batch: DataProto, data_parallel: DataParallel) -> dict[tuple[str, AggMode], float]:
    """What each aggregation mode divides by over each of `NORMALISED_MASKS` in `step_batch`, summed over the
    data-parallel ranks (each holds its own part of the optimizer step): keyed by (mask, mode)."""
    keys = [(key, mode) for key in NORMALISED_MASKS if key in step_batch.batch for mode in AGG_MODES]
    counts = torch.tensor([aggregation_count(step_batch.batch[key], mode) for key, mode in keys], dtype=torch.float64)
    return dict(zip(keys, data_parallel.sum(counts).tolist(), strict=True))


def plan_step_micro_batches(
    step_batch: DataProto,
    micro_batch_size: int,
    budget: TokenBudget | None,
    agree_count: Callable[[int], int] = int,
    data_parallel: DataParallel = SINGLE_RANK,
) -> list[MicroBatch]:
    """The micro-batches of this rank's part of one optimizer step, each told the step's counts over every
    data-parallel rank (`STEP_COUNTS`), this rank's micro-batch count (`MICRO_BATCHES_IN_STEP`) and the ranks'
    count (`DATA_PARALLEL_SIZE`).

    A loss function normalises over the whole global step with them (`step_normalised`), so the gradient
    the engine averages over the ranks' micro-batch means is the global step's however the rows were grouped
    and shared out.
    """
    micro_batches = plan_micro_batches(step_batch, micro_batch_size, budget, agree_count)
    step = {
        STEP_COUNTS: step_counts(step_batch, data_parallel),
        MICRO_BATCHES_IN_STEP: len(micro_batches),
        DATA_PARALLEL_SIZE: data_parallel.size,
    }
    for micro_batch in micro_batches:
        micro_batch.data.meta_info.update(step)
    return micro_batches


def step_normalised(
    loss: torch.Tensor, micro_batch: DataProto, mode: AggMode, mask_key: str = "response_mask"
) -> torch.Tensor:
    """A micro-batch's `loss` (aggregated over its `mask_key` by `mode`) rescaled to its global step's normaliser.

    With n the micro-batch's count (tokens for token-mean, else sequences with any), N the step's count
    over every data-parallel rank, M this rank's micro-batches in the step and D the ranks, the loss is
    scaled by n / N x M x D: the strategy's mean over the M micro-batches and the engine's mean over the D
    ranks' gradients then give the loss aggregated over the whole global step (e.g. token-mean: the sum over
    all its tokens divided by N), however the step's rows were grouped and shared out. Without step
    information (`STEP_COUNTS`, e.g. a forward pass) `loss` is returned.
    """
    counts = micro_batch.meta_info.get(STEP_COUNTS)
    if counts is None:
        return loss
    share = aggregation_count(micro_batch.batch[mask_key], mode) / max(counts[mask_key, mode], 1.0)
    return loss * (share * micro_batch.meta_info[MICRO_BATCHES_IN_STEP] * micro_batch.meta_info[DATA_PARALLEL_SIZE])


def restore_rows(
    micro_batches: list[MicroBatch], outputs: list[dict[str, torch.Tensor]], batch: DataProto
) -> dict[str, torch.Tensor]:
    """Per-row outputs of the micro-batches as one tensor per key, in `batch`'s row order and full width.

    An output of a micro-batch's sequence width goes back to its sequence columns, one of its response
    width to its response columns (zeros elsewhere); per-row scalars and other widths are kept as they are.
    """
    width, prompt_width = batch.batch["input_ids"].shape[1], _prompt_width(batch)
    order = torch.tensor([row for micro_batch in micro_batches for row in micro_batch.rows])
    restored: dict[str, torch.Tensor] = {}
    for key in outputs[0] if outputs else {}:
        parts = []
        for micro_batch, output in zip(micro_batches, outputs, strict=True):
            value = output[key]
            (start, end), (response_start, response_end) = micro_batch.columns, micro_batch.response_columns
            if value.dim() >= 2 and (start, end) != (0, width):
                if value.shape[1] == end - start:
                    value = _pad_columns(value, start, width - end)
                elif value.shape[1] == response_end - response_start:
                    value = _pad_columns(value, response_start, width - prompt_width - response_end)
            parts.append(value)
        values = torch.cat(parts)
        restored[key] = torch.empty_like(values).index_copy_(0, order.to(values.device), values)
    return restored


def _pad_columns(value: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """`value` `[n, w, ...]` with `left` and `right` zero columns added along dimension 1."""
    padding = [0, 0] * (value.dim() - 2) + [left, right]
    return F.pad(value, padding)
