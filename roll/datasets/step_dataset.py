"""Step-labelled responses (process supervision): a prompt, a response made of steps, and a label per step.

Rows come from data files (`data.prompt_key`, a list of steps `data.steps_key` and a list of 0/1 or
true/false labels `data.step_labels_key`, TRL's process-supervision columns) or from the arithmetic
task: `a+b+c=` (four values of c per `a+b`) worked in two steps, `a+b=s` and `s+c=t`, once right and
once wrong (`WRONG_KINDS`: a result off by 1 to 5 carried on, the wrong operands, a garbage step, a step cut
short, an extra step after the answer, or the first step alone); the first wrong step and every step after it are
labelled wrong (Math-Shepherd's convention). The response is
each step's tokens followed by the separator's (`data.step_separator`, tokenised on its own as TRL does,
so it never merges with a step's text); a step's label sits at its separator's last token. The response closes
with the tokenizer's EOS, labelled right when the response is a whole right answer (every file row whose steps are
all right; a built-in answer that stops after its first step is not).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from roll.configs.data_config import DEFAULT_DOMAIN, PreferenceDataArguments
from roll.configs.schema import ConfigError
from roll.datasets.arithmetic import OPERATIONS, Problem, two_steps
from roll.datasets.preference_dataset import map_columns, prompt_messages, read_splits
from roll.datasets.prompt_dataset import Example, encode_demonstrations, encode_kwargs, encode_row, usable_rows
from roll.datasets.sources import RowError, Source
from roll.datasets.unpaired_dataset import parse_label
from roll.distributed.scheduler.protocol import DataProto

MAX_THIRD_OPERAND = 19
MAX_STEP_ERROR = 5
# Built-in prompts per arithmetic problem (each with its own third operand), each answered twice (right and wrong);
# the held-out problems stay unseen.
THIRD_OPERANDS_PER_PROBLEM = 4
# The kinds of wrong answer in the built-in data and their shares: half a result off (the policy's own mistake),
# the rest what a policy drifting on a learnt reward writes (a PRM that never saw them scored such strings 0.9).
WRONG_KINDS = {"off_by": 5, "operands": 1, "garbage": 1, "truncated": 1, "extra": 1, "stop": 1}
GARBAGE_CHARACTERS = "0123456789+-=g "
MAX_GARBAGE_LENGTH = 16


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
    in two steps (`a op b=s`, `s+c=t`) twice: correctly, and wrongly in one of the `WRONG_KINDS` (`wrong_steps`,
    half of them a result off by 1 to 5). Both answers of a prompt are in the data, so a prompt alone never tells
    the labels; `complete` says whether the response is a whole correct answer (the label of its end)."""
    rng = random.Random(seed + 2)  # a stream of its own: the other built-in sets start theirs from `seed`
    rows = []
    for problem in problems:
        expression = problem.prompt[:-1]
        for third in rng.sample(range(MAX_THIRD_OPERAND + 1), THIRD_OPERANDS_PER_PROBLEM):
            prompt = [{"role": "user", "content": f"{expression}+{third}="}]
            right = two_steps(expression, int(problem.answer), third, int(problem.answer) + third)
            kind = rng.choices(list(WRONG_KINDS), weights=list(WRONG_KINDS.values()))[0]
            steps, first_error = wrong_steps(kind, expression, int(problem.answer), third, rng)
            rows.append({"messages": prompt, "steps": right, "labels": [True, True], "complete": True, "kind": ""})
            labels = [step < first_error for step in range(len(steps))]
            rows.append({"messages": prompt, "steps": steps, "labels": labels, "complete": False, "kind": kind})
    return datasets.Dataset.from_list(rows)


def wrong_steps(kind: str, expression: str, partial: int, third: int, rng: random.Random) -> tuple[list[str], int]:
    """A wrong answer of `expression + third` (whose first step's result is `partial`) of the given `WRONG_KINDS`
    kind, and the index of its first wrong step (the number of steps when every step is right but the answer
    is not whole: `stop`)."""
    offsets = [o for o in range(-MAX_STEP_ERROR, MAX_STEP_ERROR + 1) if o]
    right = two_steps(expression, partial, third, partial + third)
    at = rng.choice([0, 1])
    if kind == "off_by":  # one result off, the sum carried on from it
        wrong = partial + (rng.choice(offsets) if at == 0 else 0)
        return two_steps(expression, wrong, third, wrong + third + (rng.choice(offsets) if at == 1 else 0)), at
    if kind == "operands":  # right arithmetic on numbers the prompt does not hold
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)", expression).groups()
        if at == 0:
            a, b = (near(int(a), rng), b) if rng.random() < 0.5 else (a, near(int(b), rng))
            wrong = OPERATIONS[op](int(a), int(b))
            return two_steps(f"{a}{op}{b}", wrong, third, wrong + third), 0
        other = int(near(third, rng))
        return [right[0], two_steps(expression, partial, other, partial + other)[1]], 1
    if kind == "garbage":  # a step that is no equation of the form, and nothing after it
        text = "".join(rng.choices(GARBAGE_CHARACTERS, k=rng.randint(1, MAX_GARBAGE_LENGTH)))
        return [*right[:at], text], at
    if kind == "truncated":  # a step cut short, and nothing after it
        return [*right[:at], right[at][: rng.randint(1, len(right[at]) - 1)]], at
    if kind == "extra":  # a step after the final answer: the last one again, or the total added to
        total = partial + third
        extra = right[1] if rng.random() < 0.5 else f"{total}+{(d := rng.randint(0, MAX_THIRD_OPERAND))}={total + d}"
        return [*right, extra], 2
    if kind == "stop":  # the first step alone: right, but no answer
        return right[:1], 1
    raise ValueError(f"unknown wrong-step kind {kind!r}; use one of {sorted(WRONG_KINDS)}")


def near(number: int, rng: random.Random) -> str:
    """Another non-negative number within `MAX_STEP_ERROR` of `number`."""
    return str(
        rng.choice([n for n in range(max(0, number - MAX_STEP_ERROR), number + MAX_STEP_ERROR + 1) if n != number])
    )


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
        "complete": True,  # a file's response is a whole answer: its end is labelled as its steps are
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
    kwargs = {**encode_kwargs(tokenizer, data), "separator": separator, "eos_id": tokenizer.eos_token_id}
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
    eos_id: int | None,
) -> dict[str, Any]:
    # The prompt as every pipeline formats it; the response is built here, step by step, then the EOS a policy
    # closes with, scored as one more step: right only when every step is and the answer is whole. A causal model
    # cannot tell at a step's separator whether more steps follow; at the EOS it can (a right first step alone
    # is a wrong answer).
    encoded = encode_row({**row, "demonstration": ""}, tokenizer, chat_template, system_prompt)
    ids: list[int] = []
    ends = []
    for step in row["steps"]:
        ids += tokenizer(step, add_special_tokens=False)["input_ids"] + separator
        ends.append(len(ids) - 1)
    labels = [bool(label) for label in row["labels"]]
    if eos_id is not None and any(row["steps"]):  # a response without text stays its separator: dropped as empty
        ids.append(eos_id)
        ends.append(len(ids) - 1)
        labels.append(row["complete"] and all(labels))
    return {**encoded, "response_ids": ids, "step_ends": ends, "labels": labels}


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
