"""Scores of given sequences, what the reference, the teachers and the old-log-prob pass ask a strategy for.

Two kinds, both over a batch's response columns: each response token's log-prob `[B, R]`, and each response
position's `k` most likely ids with their log-probs `[B, R, k]`, most likely first, the softmax taken over the
first `vocab_size` ids (the ids a student also has). A forward-pass strategy reads them off its logits at the
batch's log-prob temperature (`log_probs_forward`, `top_k_forward`); a generation engine off its prompt
log-probs, which are the model's own distribution at temperature 1 (`ScoringRequest`, `ScoredSequence`,
`pack_token_log_probs`, `pack_top_k`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from roll.algorithms.distillation_losses import teacher_top_k
from roll.distributed.scheduler.protocol import DataProto
from roll.utils.functionals import response_log_probs

# meta_info key: the temperature the log-prob passes divide logits by (algorithm.log_prob_temperature).
LOG_PROB_TEMPERATURE = "log_prob_temperature"
ScoreFunc = Callable[[DataProto, Any], tuple[None, dict[str, torch.Tensor]]]


def scored_logits(logits: torch.Tensor, batch: DataProto) -> torch.Tensor:
    """`logits` at the batch's log-prob temperature (1 unless the driver set another in `meta_info`)."""
    temperature = batch.meta_info.get(LOG_PROB_TEMPERATURE, 1.0)
    return logits if temperature == 1.0 else logits / temperature


def response_logits(logits: torch.Tensor, response_length: int) -> torch.Tensor:
    """The logits that predict the last `response_length` tokens (position t - 1 predicts token t)."""
    return logits[:, -response_length - 1 : -1]


def log_probs_forward(micro_batch: DataProto, output: Any) -> tuple[None, dict[str, torch.Tensor]]:
    """`forward_step` function: `log_probs` `[B, R]` of the response tokens under the full vocabulary."""
    logits = scored_logits(output.logits, micro_batch)
    response_length = micro_batch.batch["responses"].shape[1]
    return None, {"log_probs": response_log_probs(logits, micro_batch.batch["input_ids"], response_length)}


def top_k_forward(k: int, vocab_size: int | None) -> ScoreFunc:
    """`forward_step` function: `top_indices`, `top_log_probs` `[B, R, k]` over the first `vocab_size` ids."""

    def forward(micro_batch: DataProto, output: Any) -> tuple[None, dict[str, torch.Tensor]]:
        logits = response_logits(scored_logits(output.logits, micro_batch), micro_batch.batch["responses"].shape[1])
        indices, log_probs = teacher_top_k(logits[..., :vocab_size], k)
        return None, {"top_indices": indices, "top_log_probs": log_probs}

    return forward


@dataclass
class ScoringRequest:
    """A batch as an engine scores it: each row's attended ids (prompt, then response), the index in them of its
    first response token, and the response columns its response tokens sit in (rows without any are left out)."""

    rows: list[int]
    sequences: list[list[int]]
    starts: list[int]
    columns: list[torch.Tensor]
    shape: tuple[int, int]

    @classmethod
    def of(cls, batch: DataProto) -> ScoringRequest:
        """The request for the response tokens of `batch` (`input_ids`, `attention_mask`, `responses`)."""
        temperature = batch.meta_info.get(LOG_PROB_TEMPERATURE, 1.0)
        if temperature != 1.0:
            raise ValueError(
                f"an engine scores at temperature 1 (its prompt log-probs are the model's own), not {temperature}; "
                "set algorithm.log_prob_temperature=one"
            )
        input_ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"].bool()
        width = batch.batch["responses"].shape[1]
        prompt_width = input_ids.shape[1] - width
        request = cls([], [], [], [], (len(input_ids), width))
        for row, (ids, row_mask) in enumerate(zip(input_ids, mask, strict=True)):
            prompt = ids[:prompt_width][row_mask[:prompt_width]].tolist()
            columns = row_mask[prompt_width:].nonzero().squeeze(-1)
            if not len(columns):
                continue
            if not prompt:
                raise ValueError(f"row {row} has no prompt token: its first response token has no log-prob to score")
            request.rows.append(row)
            request.sequences.append(prompt + ids[prompt_width:][columns].tolist())
            request.starts.append(len(prompt))
            request.columns.append(columns)
        return request


@dataclass
class ScoredSequence:
    """An engine's log-probs of one sequence's response tokens: `token[i]`, response token i's; `top[i]`, the
    (id, log-prob) pairs of the most likely ids at its position, most likely first (empty lists without top-k)."""

    token: list[float]
    top: list[list[tuple[int, float]]]


def pack_token_log_probs(request: ScoringRequest, scored: list[ScoredSequence]) -> torch.Tensor:
    """`[B, R]` log-probs of the response tokens, 0 where a row has none."""
    log_probs = torch.zeros(request.shape)
    for row, columns, sequence in zip(request.rows, request.columns, scored, strict=True):
        log_probs[row, columns] = torch.tensor(sequence.token, dtype=log_probs.dtype)
    return log_probs


def in_vocabulary(top: list[tuple[int, float]], k: int, vocab_size: int | None) -> list[tuple[int, float]]:
    """The `k` most likely ids below `vocab_size` of a full-vocabulary top list, renormalised over those ids.

    The list must hold k + (the ids at or above vocab_size) entries, so it holds the k sought. Only the mass of the
    dropped ids the list shows is taken out: each dropped id outside it holds less than the list's last entry, and
    the log-probs come out low by their total (nothing for a checkpoint's padding rows; tested on a random model).
    """
    if vocab_size is None:
        return top[:k]
    kept = [(token, log_prob) for token, log_prob in top if token < vocab_size][:k]
    dropped = sum(math.exp(log_prob) for token, log_prob in top if token >= vocab_size)
    if not dropped:
        return kept
    shift = math.log1p(-min(dropped, 1 - 1e-6))
    return [(token, log_prob - shift) for token, log_prob in kept]


def pack_top_k(
    request: ScoringRequest, scored: list[ScoredSequence], k: int, vocab_size: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[B, R, k]` top ids and their log-probs over the first `vocab_size` ids; index 0 and log-prob 0 where a row
    has no response token."""
    indices = torch.zeros((*request.shape, k), dtype=torch.long)
    log_probs = torch.zeros((*request.shape, k))
    for row, columns, sequence in zip(request.rows, request.columns, scored, strict=True):
        for column, top in zip(columns.tolist(), sequence.top, strict=True):
            kept = in_vocabulary(top, k, vocab_size)
            if len(kept) < k:
                raise RuntimeError(f"the engine returned {len(kept)} top log-probs in the vocabulary, not {k}")
            indices[row, column] = torch.tensor([token for token, _ in kept])
            log_probs[row, column] = torch.tensor([log_prob for _, log_prob in kept])
    return indices, log_probs
