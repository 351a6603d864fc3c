"""Step-labelled responses (process supervision): a prompt, a response made of steps, and a label per step.

Rows come from data files (`data.prompt_key`, a list of steps `data.steps_key` and a list of 0/1 or
true/false labels `data.step_labels_key`, TRL's process-supervision columns) or from the arithmetic
task: `a+b+c=` (two values of c per `a+b`) worked in two steps, `a+b=s` and `s+c=t`, once right and
once with one result wrong (off by 1 to 5) and carry on from the wrong value; the
wrong step and every step after it are labelled wrong (Math-Shepherd's convention). The response is
each step's tokens followed by the separator's (`data.step_separator`, tokenised on its own as TRL does,
so it never merges with a step's text); a step's label sits at its separator's last token.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from roll.configs.data_config import DEFAULT_DOMAIN, PreferenceDataArguments
from roll.configs.schema import ConfigError
from roll.datasets.arithmetic import Problem, two_steps
from roll.datasets.preference_dataset import map_columns, prompt_messages, read_splits
from roll.datasets.prompt_dataset import Example, encode_demonstrations, encode_kwargs, encode_row, usable_rows
from roll.datasets.sources import RowError, Source
from roll.datasets.unpaired_dataset import parse_label
from roll.distributed.scheduler.protocol import DataProto

MAX_THIRD_OPERAND = 19
MAX_STEP_ERROR = 5
# Built-in prompts per arithmetic problem (each with its own third operand), each answered twice (right and wrong);
# the held-out problems stay unseen.
THIRD_OPERANDS_PER_PROBLEM = 2


@dataclass(frozen=True)
class StepExample:
    """A prompt and its response (the `Example`'s response ids: every step followed by the separator), the
    response position of each step's last separator token, and whether each step is correct."""

    example: Example
    step_ends: tuple[int, ...]
    labels: tuple[bool, ...]


def load_step_splits(
    data: PreferenceDataArguments, tokenizer: PreTrainedTokenizerBase, max_response_length: int
) -> tuple[list[StepExample], list[StepExample]]:
    """Train and held-out step-labelled responses from `data.train_file` / `data.eval_file`, else built from the
    arithmetic task; responses too long are dropped or refused as `data.too_long` says."""
    return read_splits(data, tokenizer, max_response_length, to_step_rows, arithmetic_step_table, tokenize_steps)


def arithmetic_step_table(problems: Sequence[Problem], seed: int) -> datasets.Dataset:
    """Each problem `a op b` extended to `a op b + c` with `THIRD_OPERANDS_PER_PROBLEM` values of c, each worked
    in two steps (`a op b=s`, `s+c=t`) twice: correctly, and with one result wrong (the first or the second
    step, off by 1 to 5), after which the sum goes on from the wrong value and every later step is labelled
    wrong. Both answers of a prompt are in the data, so a prompt alone never tells the labels."""
    rng = random.Random(seed + 2)  # a stream of its own: the other built-in sets start theirs from `seed`
    offsets = [o for o in range(-MAX_STEP_ERROR, MAX_STEP_ERROR + 1) if o]
    rows = []
    for problem in problems:
        expression = problem.prompt[:-1]
        for third in rng.sample(range(MAX_THIRD_OPERAND + 1), THIRD_OPERANDS_PER_PROBLEM):
            for first_error in (None, rng.choice([0, 1])):
                partial = int(problem.answer) + (rng.choice(offsets) if first_error == 0 else 0)
                total = partial + third + (rng.choice(offsets) if first_error == 1 else 0)
                rows.append(
                    {
                        "messages": [{"role": "user", "content": f"{expression}+{third}="}],
                        "steps": two_steps(expression, partial, third, total),
                        "labels": [first_error is None or step < first_error for step in range(2)],
                    }
                )
    return datasets.Dataset.from_list(rows)


def to_step_rows(table: datasets.Dataset, data: PreferenceDataArguments, source: Source) -> datasets.Dataset:
    """`table` mapped onto (messages, steps, labels) through `data.prompt_key`, `steps_key` and `step_labels_key`;
    steps that are not a list of text, or labels not one 0/1/true/false per step, are a ConfigError naming the
    file, the row and the field."""
    settings = ("prompt_key", "steps_key", "step_labels_key")
    return map_columns(table, data, settings, _normalize, source, "reading step-labelled responses")


def _normalize(row: dict[str, Any], prompt_key: str, steps_key: str, step_labels_key: str) -> dict[str, Any]:
    steps, labels = row[steps_key], row[step_labels_key]
    if not isinstance(steps, list) or not steps or not all(isinstance(step, str) for step in steps):
        raise RowError(f"data.steps_key={steps_key!r} holds {steps!r:.80}, not a non-empty list of steps")
    if not isinstance(labels, list) or len(labels) != len(steps):
        count = f"{len(labels)} labels" if isinstance(labels, list) else repr(labels)
        raise RowError(
            f"data.step_labels_key={step_labels_key!r} holds {count} for the {len(steps)} steps of "
            f"data.steps_key={steps_key!r}; give one label per step"
        )
    return {
        "messages": prompt_messages(row[prompt_key], prompt_key),
        "steps": steps,
        "labels": [
            parse_label(label, f"data.step_labels_key={step_labels_key!r} label {i}") for i, label in enumerate(labels)
        ],
    }


def tokenize_steps(
    table: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    data: PreferenceDataArguments,
    max_response_length: int,
    source: Source,
) -> list[StepExample]:
    """Step examples of `table`'s rows: prompt formatted as configured, each step and its separator tokenised,
    too-long responses handled."""

    def response_text(steps: list[str]) -> str:
        return "".join(step + data.step_separator for step in steps)

    separator = separator_ids(tokenizer, data.step_separator, "data.step_separator")
    kwargs = {**encode_kwargs(tokenizer, data), "separator": separator}
    encoded = table.map(_encode_steps, fn_kwargs=kwargs, desc="tokenizing")
    kept = usable_rows(encoded, data, max_response_length, source, {"response_ids": "response"})
    return [
        StepExample(
            Example(row["prompt"], response_text(row["steps"]), DEFAULT_DOMAIN, row["prompt_ids"], row["response_ids"]),
            tuple(row["step_ends"]),
            tuple(row["labels"]),
        )
        for row in kept.to_list()
    ]


def separator_ids(tokenizer: PreTrainedTokenizerBase, separator: str, field_name: str) -> list[int]:
    """The separator's token ids, tokenised on its own as the steps of training data are; a ConfigError naming
    `field_name` when it has none."""
    ids = tokenizer(separator, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ConfigError(
            f"{field_name}={separator!r} has no tokens under the model's tokenizer; set another separator"
        )
    return ids


def response_step_ends(response_ids: Sequence[int], separator: Sequence[int]) -> list[int]:
    """Where the steps of a generated response end: the last token of each occurrence of `separator` (read left to
    right, without overlaps), then the last token when text follows the last separator (a final step cut short).

    On a response built from steps as `_encode_steps` builds it, these are its `step_ends`: a model trained on
    those positions is read at the same ones.
    """
    ends, width, start, position = [], len(separator), 0, 0
    while position + width <= len(response_ids):
        if list(response_ids[position : position + width]) == list(separator):
            position += width
            ends.append(position - 1)
            start = position
        else:
            position += 1
    if start < len(response_ids):
        ends.append(len(response_ids) - 1)
    return ends


def _encode_steps(
    row: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    chat_template: bool,
    system_prompt: str,
    separator: list[int],
) -> dict[str, Any]:
    # The prompt as every pipeline formats it; the response is built here, step by step, without EOS: it ends at
    # its last step's separator, so its last token's score is the last step's.
    encoded = encode_row({**row, "demonstration": ""}, tokenizer, chat_template, system_prompt)
    ids: list[int] = []
    ends = []
    for step in row["steps"]:
        ids += tokenizer(step, add_special_tokens=False)["input_ids"] + separator
        ends.append(len(ids) - 1)
    return {**encoded, "response_ids": ids, "step_ends": ends}


def encode_steps(rows: Sequence[StepExample], pad_id: int) -> DataProto:
    """The rows in `encode_demonstrations`' layout, plus `step_mask` `[B, R]` (1 at each step's last separator
    token) and `step_labels` `[B, R]` (its label there, 0 elsewhere)."""
    batch = encode_demonstrations([row.example for row in rows], pad_id)
    shape = batch.batch["responses"].shape
    mask, labels = torch.zeros(shape, dtype=torch.long), torch.zeros(shape)
    for i, row in enumerate(rows):
        ends = torch.tensor(row.step_ends)
        mask[i, ends] = 1
        labels[i, ends] = torch.tensor(row.labels, dtype=labels.dtype)
    return batch.union(DataProto.from_dict(tensors={"step_mask": mask, "step_labels": labels}))
