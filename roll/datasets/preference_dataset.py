"""Preference pairs: a prompt with a chosen and a rejected response, from data files or the arithmetic task.

The built-in pairs prefer each arithmetic problem's correct answer over a wrong one near it. File rows
are mapped through `data.prompt_key`, `data.chosen_key` and `data.rejected_key`, then formatted,
tokenised and length-checked like SFT demonstrations (`roll.datasets.prompt_dataset`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import datasets
from transformers import PreTrainedTokenizerBase

from roll.configs.data_config import DEFAULT_DOMAIN, PreferenceDataArguments
from roll.configs.schema import ConfigError
from roll.datasets.arithmetic import Problem, wrong_answers
from roll.datasets.prompt_dataset import (
    Example,
    encode_demonstrations,
    encode_kwargs,
    encode_row,
    response_ids,
    split_tables,
    usable_rows,
)
from roll.datasets.sources import (
    RowError,
    Source,
    check_text_columns,
    named_rows,
    quiet_progress,
    split_conversation,
)
from roll.distributed.scheduler.protocol import DataProto


@dataclass(frozen=True)
class PreferencePair:
    """One prompt's chosen and rejected responses, each an `Example` whose response is that answer."""

    chosen: Example
    rejected: Example


def load_preference_splits(
    data: PreferenceDataArguments, tokenizer: PreTrainedTokenizerBase, max_response_length: int
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """Train and held-out pairs from `data.train_file` / `data.eval_file`, else the built-in arithmetic pairs.

    Pairs whose prompt or either response is too long are dropped or refused as `data.too_long` says.
    """
    return read_splits(
        data, tokenizer, max_response_length, to_preference_rows, arithmetic_preference_table, tokenize_pairs
    )


T = TypeVar("T")


def read_splits(
    data: PreferenceDataArguments,
    tokenizer: PreTrainedTokenizerBase,
    max_response_length: int,
    from_file: Callable[[datasets.Dataset, PreferenceDataArguments, Source], datasets.Dataset],
    built_in: Callable[[Sequence[Problem], int], datasets.Dataset],
    tokenize: Callable[[datasets.Dataset, PreTrainedTokenizerBase, PreferenceDataArguments, int, Source], list[T]],
) -> tuple[list[T], list[T]]:
    """The train and held-out examples of one preference format: the data files mapped onto its columns by
    `from_file`, else the arithmetic task's splits made into its rows by `built_in` (given `data.task_seed`),
    then tokenised (too-long rows handled) by `tokenize`."""
    with quiet_progress():
        tables = split_tables(
            data,
            lambda table, source: from_file(table, data, source),
            lambda problems: built_in(problems, data.task_seed),
        )
        train, held_out = (tokenize(table, tokenizer, data, max_response_length, source) for table, source in tables)
        return train, held_out


def arithmetic_preference_table(problems: Sequence[Problem], seed: int) -> datasets.Dataset:
    """The arithmetic `problems` as preference rows: the correct answer chosen, a wrong one near it rejected."""
    return datasets.Dataset.from_list(
        [
            {"messages": [{"role": "user", "content": p.prompt}], "chosen": p.answer, "rejected": wrong}
            for p, wrong in zip(problems, wrong_answers(list(problems), seed=seed), strict=True)
        ]
    )


def to_preference_rows(table: datasets.Dataset, data: PreferenceDataArguments, source: Source) -> datasets.Dataset:
    """`table` mapped onto (messages, chosen, rejected) through `data.prompt_key`, `chosen_key` and `rejected_key`."""
    check_text_columns(table, source, [data.chosen_key, data.rejected_key])
    return map_columns(table, data, ("prompt_key", "chosen_key", "rejected_key"), _normalize, source, "reading pairs")


def map_columns(
    table: datasets.Dataset,
    data: PreferenceDataArguments,
    settings: tuple[str, ...],
    normalize: Callable[..., dict[str, Any]],
    source: Source,
    desc: str,
) -> datasets.Dataset:
    """`table`'s rows replaced by `normalize(row, **{setting: data.<setting>})` (a RowError naming the row, see
    `named_rows`), after checking that `table` has the column each `data.<setting>` names."""
    columns = table.column_names
    for setting in settings:
        key = getattr(data, setting)
        if key not in columns:
            existing = ", ".join(repr(c) for c in columns)
            raise ConfigError(f"{source}: no column {key!r} (data.{setting}); its columns are {existing}")
    keys = {setting: getattr(data, setting) for setting in settings}
    return table.map(
        named_rows(normalize),
        with_indices=True,
        fn_kwargs={**keys, "source": source},
        remove_columns=columns,
        desc=desc,
    )


def _normalize(row: dict[str, Any], prompt_key: str, chosen_key: str, rejected_key: str) -> dict[str, Any]:
    return {
        "messages": prompt_messages(row[prompt_key], prompt_key),
        "chosen": response_text(row[chosen_key], f"data.chosen_key={chosen_key!r}"),
        "rejected": response_text(row[rejected_key], f"data.rejected_key={rejected_key!r}"),
    }


def prompt_messages(prompt: Any, prompt_key: str) -> list[dict[str, str]]:
    """A prompt given as text, or as a conversation ending with the user's turn, as a list of messages."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    messages, answer = split_conversation(prompt, f"data.prompt_key={prompt_key!r}")
    if answer is not None:
        raise RowError(
            f"the prompt (data.prompt_key={prompt_key!r}) ends with an assistant turn; a preference "
            "prompt ends with the user's turn, its responses are in their own columns"
        )
    return messages


def response_text(value: Any, setting: str) -> str:
    """A response given as text, or as a conversation whose last turn is the assistant's."""
    if isinstance(value, str):
        return value
    last = value[-1] if isinstance(value, list) and value else None
    if isinstance(last, dict) and last.get("role") == "assistant" and isinstance(last.get("content"), str):
        return last["content"]
    raise RowError(f"{setting} holds {value!r:.80}, not text or a conversation ending with an assistant turn")


def tokenize_pairs(
    table: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    data: PreferenceDataArguments,
    max_response_length: int,
    source: Source,
) -> list[PreferencePair]:
    """Pairs of `table`'s rows: prompt formatted as configured, both responses tokenised, unusable pairs (too long,
    an empty response, chosen the same as rejected) handled."""
    encoded = table.map(_encode_pair, fn_kwargs=encode_kwargs(tokenizer, data), desc="tokenizing")
    responses = {"response_ids": "chosen response", "rejected_ids": "rejected response"}
    kept = usable_rows(encoded, data, max_response_length, source, responses)
    return [
        PreferencePair(
            chosen=Example(row["prompt"], row["chosen"], DEFAULT_DOMAIN, row["prompt_ids"], row["response_ids"]),
            rejected=Example(row["prompt"], row["rejected"], DEFAULT_DOMAIN, row["prompt_ids"], row["rejected_ids"]),
        )
        for row in kept.to_list()
    ]


def _encode_pair(
    row: dict[str, Any], tokenizer: PreTrainedTokenizerBase, chat_template: bool, system_prompt: str
) -> dict[str, Any]:
    encoded = encode_row({**row, "demonstration": row["chosen"]}, tokenizer, chat_template, system_prompt)
    return {**encoded, "rejected_ids": response_ids(row["rejected"], tokenizer)}


def encode_pairs(pairs: Sequence[PreferencePair], pad_id: int) -> DataProto:
    """Each pair's chosen row followed by its rejected row (chosen at even rows, rejected at odd ones).

    The layout is `encode_demonstrations`' (prompts left-padded, responses right-padded), so one forward
    pass over the batch scores both responses of every pair.
    """
    return encode_demonstrations([example for pair in pairs for example in (pair.chosen, pair.rejected)], pad_id)
