"""Unpaired preference data (KTO): a prompt, one completion and whether it is desirable.

Rows come from data files (`data.prompt_key`, `data.completion_key` and a 0/1 or true/false
`data.label_key`, TRL's KTO columns) or from the arithmetic task: every problem appears once, with
its correct answer (desirable) or a wrong one near it (undesirable) by a seeded coin, so no batch
holds a prompt's two answers side by side. Preference pairs can be read the same way (chosen
desirable, rejected undesirable). KTO's reference point is estimated on mismatched rows: a prompt
of the batch with another prompt's completion (`mismatched_examples`).
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from roll.configs.data_config import DEFAULT_DOMAIN, PreferenceDataArguments
from roll.configs.schema import ConfigError
from roll.datasets.arithmetic import Problem, wrong_answers
from roll.datasets.preference_dataset import (
    PreferencePair,
    map_columns,
    prompt_messages,
    read_splits,
    response_text,
)
from roll.datasets.prompt_dataset import (
    Example,
    encode_demonstrations,
    encode_kwargs,
    encode_row,
    usable_rows,
)
from roll.datasets.sources import RowError, Source, check_text_columns
from roll.distributed.scheduler.protocol import DataProto

logger = logging.getLogger(__name__)
_TRUE, _FALSE = {"1", "true"}, {"0", "false"}


@dataclass(frozen=True)
class LabelledExample:
    """A prompt with one completion (the `Example`'s response) and whether that completion is desirable."""

    example: Example
    desirable: bool


def load_unpaired_splits(
    data: PreferenceDataArguments, tokenizer: PreTrainedTokenizerBase, max_response_length: int
) -> tuple[list[LabelledExample], list[LabelledExample]]:
    """Train and held-out labelled completions from `data.train_file` / `data.eval_file`, else built from the
    arithmetic task; rows too long are dropped or refused as `data.too_long` says."""
    return read_splits(
        data, tokenizer, max_response_length, to_unpaired_rows, arithmetic_unpaired_table, tokenize_labelled
    )


def arithmetic_unpaired_table(problems: Sequence[Problem], seed: int) -> datasets.Dataset:
    """Each problem once, answered correctly (label 1) or with a wrong answer near the correct one (label 0)."""
    coin = random.Random(seed + 1)  # not `wrong_answers`' own stream, which the same seed starts
    rows = []
    for problem, wrong in zip(problems, wrong_answers(list(problems), seed=seed), strict=True):
        desirable = coin.random() < 0.5
        completion = problem.answer if desirable else wrong
        messages = [{"role": "user", "content": problem.prompt}]
        rows.append({"messages": messages, "demonstration": completion, "desirable": desirable})
    return datasets.Dataset.from_list(rows)


def to_unpaired_rows(table: datasets.Dataset, data: PreferenceDataArguments, source: Source) -> datasets.Dataset:
    """`table` mapped onto (messages, demonstration, desirable) through `data.prompt_key`, `completion_key` and
    `label_key`; a label other than 0/1/true/false is a ConfigError naming the file, the row and the column."""
    settings = ("prompt_key", "completion_key", "label_key")
    check_text_columns(table, source, [data.completion_key])
    return map_columns(table, data, settings, _normalize, source, "reading labelled completions")


def _normalize(row: dict[str, Any], prompt_key: str, completion_key: str, label_key: str) -> dict[str, Any]:
    return {
        "messages": prompt_messages(row[prompt_key], prompt_key),
        "demonstration": response_text(row[completion_key], f"data.completion_key={completion_key!r}"),
        "desirable": parse_label(row[label_key], f"column {label_key!r} (data.label_key)"),
    }


def parse_label(value: Any, where: str) -> bool:
    """A label as a bool: true/false, 1/0 (numbers or text, any case); anything else is a RowError naming `where`
    (the column, or the label's place in it)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise RowError(f"{where} holds {value!r}, not a label: use 1/true (desirable) or 0/false (undesirable)")


def tokenize_labelled(
    table: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    data: PreferenceDataArguments,
    max_response_length: int,
    source: Source,
) -> list[LabelledExample]:
    """Labelled examples of `table`'s rows: prompt formatted as configured, completion tokenised, unusable rows
    (too long, an empty completion) handled."""
    encoded = table.map(encode_row, fn_kwargs=encode_kwargs(tokenizer, data), desc="tokenizing")
    kept = usable_rows(encoded, data, max_response_length, source, {"response_ids": "completion"})
    return [
        LabelledExample(
            Example(row["prompt"], row["demonstration"], DEFAULT_DOMAIN, row["prompt_ids"], row["response_ids"]),
            row["desirable"],
        )
        for row in kept.to_list()
    ]


def pairs_unpaired(pairs: Sequence[PreferencePair]) -> list[LabelledExample]:
    """Pairs read as unpaired rows: each chosen response desirable, then its rejected one undesirable."""
    return [
        row for pair in pairs for row in (LabelledExample(pair.chosen, True), LabelledExample(pair.rejected, False))
    ]


def encode_labelled(rows: Sequence[LabelledExample], pad_id: int) -> DataProto:
    """The rows in `encode_demonstrations`' layout, plus `desirable` `[B]` (bool)."""
    batch = encode_demonstrations([row.example for row in rows], pad_id)
    desirable = torch.tensor([row.desirable for row in rows], dtype=torch.bool)
    return batch.union(DataProto.from_dict(tensors={"desirable": desirable}))


def require_both_labels(desirable: torch.Tensor, source: str) -> None:
    """Raise ConfigError naming `source` unless the labels `desirable` hold both classes."""
    count = int(desirable.sum())
    if count in (0, len(desirable)):
        label = "desirable" if count else "undesirable"
        raise ConfigError(f"the {len(desirable)} rows of {source} are all {label}; give both labels")


def mismatched_examples(examples: Sequence[Example]) -> list[Example]:
    """Rows of the batch's prompts each with the completion of a row whose prompt differs (KTO's reference point).

    Rows that share a prompt text are one group (a pair read unpaired, or the same prompt twice). The rows
    are laid out group after group, largest first, and each takes the completion `m` places further on,
    where `m` is the largest group's size. When no prompt fills more than half of the batch this pairs
    every row with another prompt's completion (a group spans at most `m` consecutive places). Distinct
    prompts take the next row's completion (TRL's shift by 1), pairs side by side the next pair's.

    When one prompt fills more than half of the batch, no arrangement can give all its rows another
    prompt's completion: the rows left with a completion of their own prompt are left out (a warning says
    how many), so the estimate only ever sees mismatched rows. A batch whose rows all share one prompt
    (a single row included) has no mismatched row: ValueError.
    """
    groups: dict[str, list[int]] = {}
    for i, example in enumerate(examples):
        groups.setdefault(example.prompt, []).append(i)
    if len(groups) < 2:
        raise ValueError(
            f"KTO's reference point scores prompts with completions of other prompts, but the {len(examples)} "
            "row(s) of this batch share one prompt; use a batch_size of rows with at least two different prompts"
        )
    ordered = sorted(groups.values(), key=len, reverse=True)  # stable: equal sizes keep the batch's order
    shift = len(ordered[0])
    order = [i for rows in ordered for i in rows]
    partner = {row: order[(k + shift) % len(order)] for k, row in enumerate(order)}
    kept = [i for i, example in enumerate(examples) if examples[partner[i]].prompt != example.prompt]
    if len(kept) < len(examples):
        logger.warning(
            "one prompt fills %d of the %d rows of this KTO batch: its reference point is estimated on the %d "
            "rows that can take another prompt's completion",
            shift,
            len(examples),
            len(kept),
        )
    return [
        dataclasses.replace(
            examples[i], answer=examples[partner[i]].answer, response_ids=examples[partner[i]].response_ids
        )
        for i in kept
    ]
