"""Prompt datasets: the built-in arithmetic task or data files, formatted, tokenised and batched into DataProtos.

Formatting, tokenising and the length filter are `datasets` maps, so data read from files is
processed once and then read back from the `datasets` cache.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase, ProcessorMixin

from roll.configs.data_config import DEFAULT_DOMAIN, DataArguments, SourceArguments
from roll.configs.schema import ConfigError
from roll.datasets.arithmetic import Problem, arithmetic_problems, two_step_problems
from roll.datasets.chat_format import format_prompt, use_chat_template
from roll.datasets.image_prompts import encode_image_rows
from roll.datasets.sources import Source, quiet_progress, read_table, to_conversations
from roll.datasets.visual_shapes import ShapeProblem, colour_problems, shape_problems
from roll.distributed.scheduler.protocol import DataProto
from roll.models.vision_inputs import image_columns

logger = logging.getLogger(__name__)
BUILT_IN = "the built-in arithmetic task"


@dataclass(frozen=True)
class Example:
    """A problem as the model reads it: the formatted prompt and its token ids, the demonstrated response's
    ids (ending with EOS, for SFT), the answer a reward checks and the reward domain."""

    prompt: str
    answer: str
    domain: str
    prompt_ids: list[int]
    response_ids: list[int]
    # A prompt with images (vision-language models): its processed pixels and image grid (`image_prompts`).
    pixel_values: np.ndarray | None = None
    image_grid_thw: np.ndarray | None = None


def load_splits(
    data: DataArguments,
    tokenizer: PreTrainedTokenizerBase,
    max_response_length: int | None = None,
    processor: ProcessorMixin | None = None,
) -> tuple[list[Example], list[Example]]:
    """Train and held-out examples from `data.train_file` / `data.eval_file`, else the built-in arithmetic task.

    Rows too long for `data.max_prompt_length` (or, when given, `max_response_length`) are dropped
    or refused as `data.too_long` says; rows with an empty answer are dropped (`usable_rows`). With the
    `processor` of a vision-language model, rows carry images (`roll.datasets.image_prompts`): the data files'
    image rows, or the built-in `visual_count` and `visual_colour` tasks.
    """
    if processor is not None:
        with quiet_progress():
            return image_splits(data, processor, max_response_length)
    if data.task in VISUAL_TASKS:
        raise ConfigError(
            f"data.task={data.task} shows the model pictures: the model must be a vision-language one "
            f"(e.g. tiny://qwen2_5_vl), not {tokenizer.name_or_path}"
        )
    with quiet_progress():
        tables = split_tables(data, lambda table, source: to_conversations(table, data, source), task_table(data))
        train, held_out = (tokenize(table, tokenizer, data, max_response_length, source) for table, source in tables)
        return train, held_out


def split_tables(
    data: SourceArguments,
    from_file: Callable[[datasets.Dataset, Source], datasets.Dataset],
    built_in: Callable[[list[Problem]], datasets.Dataset],
) -> list[tuple[datasets.Dataset, Source]]:
    """(table, source) of the train and held-out splits: `data.train_file` / `data.eval_file` read and mapped by
    `from_file`, else the built-in arithmetic task's splits made into tables by `built_in`."""
    if bool(data.train_file) != bool(data.eval_file):
        given, missing = ("train_file", "eval_file") if data.train_file else ("eval_file", "train_file")
        raise ConfigError(
            f"data.{missing} is empty but data.{given} is set: give both, or neither for the built-in arithmetic task"
        )
    if data.train_file:
        sources = [Source.of(f"data.{key}", getattr(data, key)) for key in ("train_file", "eval_file")]
        return [(from_file(read_table(source), source), source) for source in sources]
    splits = zip(
        arithmetic_problems(max_operand=data.task_max_operand, seed=data.task_seed), ("train", "held out"), strict=True
    )
    return [(built_in(problems), Source(f"{BUILT_IN} ({name})")) for problems, name in splits]


def task_table(data: DataArguments) -> Callable[[Sequence[Problem]], datasets.Dataset]:
    """How the built-in task's problems become a table (`data.task`): as they are, or each worked in two steps."""
    if data.task == "two_step_arithmetic":
        return lambda problems: problems_table(two_step_problems(list(problems), data.task_seed))
    return problems_table


def image_splits(
    data: DataArguments, processor: ProcessorMixin, max_response_length: int | None
) -> tuple[list[Example], list[Example]]:
    """`load_splits` for a vision-language model: the data files' rows (their images in `data.images_key` or in
    the image parts), else the built-in task (`visual_count`, `visual_colour`: pictures; the arithmetic tasks:
    text alone)."""
    if data.train_file or data.eval_file:
        tables = split_tables(data, lambda table, source: table, task_table(data))
        splits = [([_image_row(row, data, s, i) for i, row in enumerate(t.to_list())], s) for t, s in tables]
    elif data.task in VISUAL_TASKS:
        problems = VISUAL_TASKS[data.task](VISUAL_TRAIN_PROBLEMS, VISUAL_HELD_OUT_PROBLEMS, seed=data.task_seed)
        splits = [
            ([_shape_row(p) for p in ps], Source(f"the built-in {data.task} task ({name})"))
            for ps, name in zip(problems, ("train", "held out"), strict=True)
        ]
    else:
        tables = split_tables(data, lambda table, source: table, task_table(data))
        splits = [(t.to_list(), s) for t, s in tables]
    examples = []
    for rows, source in splits:
        encoded = encode_image_rows(rows, processor, data, source)
        for row in encoded:
            row["response_ids"] = response_ids(row.pop("demonstration"), processor.tokenizer)
        checked = datasets.Dataset.from_dict(
            {
                "prompt": [r["prompt"] for r in encoded],
                "prompt_ids": [r["prompt_ids"] for r in encoded],
                "response_ids": [r["response_ids"] for r in encoded],
                _ROW: list(range(len(encoded))),
            }
        )
        kept = usable_rows(checked, data, max_response_length, source, {"response_ids": "demonstration"})
        examples.append([Example(**encoded[i]) for i in kept[_ROW]])
    return examples[0], examples[1]


_ROW = "row_index"
VISUAL_TRAIN_PROBLEMS, VISUAL_HELD_OUT_PROBLEMS = 512, 128
VISUAL_TASKS = {"visual_count": shape_problems, "visual_colour": colour_problems}


def _shape_row(problem: ShapeProblem) -> dict[str, Any]:
    content = [{"type": "image"}, {"type": "text", "text": problem.question}]
    return {
        "messages": [{"role": "user", "content": content}],
        "images": [problem.image],
        "answer": problem.answer,
        "demonstration": problem.answer,
        "domain": DEFAULT_DOMAIN,
    }


def _image_row(row: dict[str, Any], data: DataArguments, source: Source, index: int) -> dict[str, Any]:
    """A data file's row as `encode_image_rows` reads it: its conversation, images, answer and domain."""
    prompt = row.get(data.prompt_key)
    if prompt is None:
        raise ConfigError(f"{source}: {source.row(index)} has no column {data.prompt_key!r} (data.prompt_key)")
    images = row.get(data.images_key) or []
    images = images if isinstance(images, list) else [images]  # a column of one image a row
    if isinstance(prompt, str):
        # A text prompt with an image column (a geometry dataset's `problem` and `images`): the images first, then
        # the text without its `<image>` markers.
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt.replace("<image>", "")}]
        turns = [{"role": "user", "content": content if images else prompt}]
    else:
        turns = list(prompt)
    demonstration = turns.pop()["content"] if turns and turns[-1].get("role") == "assistant" else None
    answer = row.get(data.answer_key, demonstration)
    if answer is None:
        raise ConfigError(
            f"{source}: {source.row(index)} has no {data.answer_key!r} (data.answer_key) nor an answer turn"
        )
    if demonstration is not None and not isinstance(demonstration, str):
        raise ConfigError(f"{source}: {source.row(index)}: the assistant turn must be text")
    return {
        "messages": turns,
        "images": images,
        "answer": str(answer),
        "demonstration": str(answer) if demonstration is None else demonstration,
        "domain": str(row.get(data.domain_key) or DEFAULT_DOMAIN),
    }


def problems_table(problems: Sequence[Problem]) -> datasets.Dataset:
    """`problems` as a table of roll's columns (a one-turn conversation each)."""
    return datasets.Dataset.from_list(
        [
            {
                "messages": [{"role": "user", "content": p.prompt}],
                "answer": p.answer,
                "demonstration": p.demonstration or p.answer,
                "domain": p.domain,
            }
            for p in problems
        ]
    )


def tokenize(
    table: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    data: SourceArguments,
    max_response_length: int | None,
    source: Source,
) -> list[Example]:
    """Examples of `table`'s rows: formatted (chat template as configured), tokenised, unusable rows handled."""
    encoded = table.map(
        encode_row,
        fn_kwargs=encode_kwargs(tokenizer, data),
        remove_columns=["messages", "demonstration"],
        desc="tokenizing",
    )
    kept = usable_rows(encoded, data, max_response_length, source, {"response_ids": "demonstration"})
    return [Example(**row) for row in kept.to_list()]


def encode_kwargs(tokenizer: PreTrainedTokenizerBase, data: SourceArguments) -> dict[str, Any]:
    """The keyword arguments of `encode_row` for `data`'s formatting."""
    return {
        "tokenizer": tokenizer,
        "chat_template": use_chat_template(data.apply_chat_template, tokenizer),
        "system_prompt": data.system_prompt,
    }


def usable_rows(
    encoded: datasets.Dataset,
    data: SourceArguments,
    max_response_length: int | None,
    source: Source,
    responses: dict[str, str],
) -> datasets.Dataset:
    """The rows of `encoded` to train on; each other row is named (file and line) in a warning or an error.

    `responses` maps each response column of token ids to what messages call it. A row too long for the limits
    (`data.max_prompt_length`; `max_response_length`, when given, for every response) is dropped with a warning
    or refused, as `data.too_long` says. A degenerate row, one with an empty response (no token but its end) or
    with two responses that are the same (a pair's chosen and rejected), is dropped with a warning: it teaches
    nothing. A split left without rows is a ConfigError.
    """
    limits = {
        "max_prompt_length": data.max_prompt_length,
        "max_response_length": max_response_length,
        "columns": list(responses),
    }
    checked = encoded.map(_row_problems, batched=True, fn_kwargs=limits, desc="checking rows")
    rows: dict[str, list[int]] = {}
    for index, problem in enumerate(checked[_PROBLEM]):
        if problem:
            rows.setdefault(problem, []).append(index)
    if not rows:
        return encoded
    kept = checked.filter(_usable, input_columns=_PROBLEM, batched=True, desc="dropping rows")
    kept = kept.remove_columns(_PROBLEM)
    names = list(responses.values())
    for problem, indices in rows.items():
        what = {
            "too long": f"prompts longer than data.max_prompt_length={data.max_prompt_length} tokens"
            + ("" if max_response_length is None else f" or {_LONG_RESPONSES}={max_response_length} tokens"),
            "empty": f"an empty {' or '.join(names)}",
            "same": f"the same {' and '.join(names)}",
        }[problem]
        if (problem == "too long" and data.too_long == "error") or not len(kept):
            first = indices[0]
            fix = "raise the limit, or set data.too_long=drop to leave them out" if len(kept) else "fix the rows"
            fix = "raise the limit" if problem == "too long" and not len(kept) else fix
            raise ConfigError(
                f"{source}: {len(indices)} of {len(encoded)} rows have {what}, e.g. {source.row(first)} "
                f"({encoded[first]['prompt']!r}); {fix}"
            )
        named = ", ".join(source.row(i) for i in indices[:3]) + (", ..." if len(indices) > 3 else "")
        logger.warning("%s: dropped %d of %d rows with %s: %s", source, len(indices), len(encoded), what, named)
    return kept


_PROBLEM = "row_problem"
_LONG_RESPONSES = "demonstrations longer than max_response_length"


def _row_problems(
    rows: dict[str, list[Any]], max_prompt_length: int, max_response_length: int | None, columns: list[str]
) -> dict[str, list[str]]:
    """What makes each tokenised row of a batch unusable: "too long", "empty", "same", or "" when nothing does."""

    def problem(i: int) -> str:
        responses = [rows[c][i] for c in columns]
        long = max_response_length is not None and any(len(ids) > max_response_length for ids in responses)
        if long or len(rows["prompt_ids"][i]) > max_prompt_length:
            return "too long"
        if any(len(ids) <= 1 for ids in responses):
            return "empty"
        return "same" if len(responses) == 2 and responses[0] == responses[1] else ""

    return {_PROBLEM: [problem(i) for i in range(len(rows["prompt_ids"]))]}


def _usable(problems: list[str]) -> list[bool]:
    return [not problem for problem in problems]


def response_ids(text: str, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The token ids of a response `text`, ending with EOS (the model learns to stop there). Blank text (spaces,
    newlines) is an empty response: EOS alone, which `usable_rows` drops with the empty ones."""
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"] if text.strip() else []
    return [*tokens, tokenizer.eos_token_id]


def encode_row(
    row: dict[str, Any], tokenizer: PreTrainedTokenizerBase, chat_template: bool, system_prompt: str
) -> dict[str, Any]:
    """A row's formatted prompt, its ids and the ids of its `demonstration`."""
    prompt = format_prompt(row["messages"], tokenizer, chat_template, system_prompt)
    return {
        "prompt": prompt,
        "prompt_ids": tokenizer(prompt, add_special_tokens=False)["input_ids"],
        "response_ids": response_ids(row["demonstration"], tokenizer),
    }


def encode_prompts(examples: Sequence[Example], pad_id: int) -> DataProto:
    """Left-padded prompt ids and masks, with the prompt text, answer and domain per row, and each row's pixel
    values and image grid when the examples have images (`roll.models.vision_inputs`)."""
    ids, mask = _pad([e.prompt_ids for e in examples], pad_id, left=True)
    non_tensors = {
        "prompt": [e.prompt for e in examples],
        "answer": [e.answer for e in examples],
        "domain": [e.domain for e in examples],
    }
    if any(e.pixel_values is not None for e in examples):
        non_tensors.update(image_columns([e.pixel_values for e in examples], [e.image_grid_thw for e in examples]))
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask}, non_tensors=non_tensors)


def _pad(rows: Sequence[Sequence[int]], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = [[pad_id] * (width - len(r)) + list(r) if left else list(r) + [pad_id] * (width - len(r)) for r in rows]
    mask = [[0] * (width - len(r)) + [1] * len(r) if left else [1] * len(r) + [0] * (width - len(r)) for r in rows]
    return torch.tensor(ids), torch.tensor(mask)


class PromptSampler:
    """Endless shuffled batches of examples; its position is part of a checkpoint."""

    def __init__(self, examples: Sequence[Example], batch_size: int, seed: int) -> None:
        if batch_size > len(examples):
            raise ValueError(f"batch size {batch_size} is larger than the {len(examples)} training problems")
        self.examples = list(examples)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[Example]:
        """The next `batch_size` examples; a new shuffled epoch starts when fewer remain."""
        if self.position + self.batch_size > len(self._order):
            self.epoch += 1
            self.position = 0
            self._order = self._shuffled(self.epoch)
        indices = self._order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return [self.examples[i] for i in indices]

    def state_dict(self) -> dict[str, int]:
        """Where the sampler is, for a checkpoint."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a checkpointed position."""
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._shuffled(self.epoch)


def domain_counts(batch_size: int, weights: dict[str, float]) -> dict[str, int]:
    """Each domain's rows in a batch of `batch_size`: its share by weight, rounded by largest remainder.

    Raises ValueError when a domain would get no row.
    """
    total = sum(weights.values())
    exact = {domain: batch_size * weight / total for domain, weight in weights.items()}
    counts = {domain: int(share) for domain, share in exact.items()}
    by_remainder = sorted(exact, key=lambda d: (counts[d] - exact[d], d))
    for domain in by_remainder[: batch_size - sum(counts.values())]:
        counts[domain] += 1
    empty = sorted(domain for domain, count in counts.items() if count == 0)
    if empty:
        raise ValueError(f"domain(s) {empty} get no row of a batch of {batch_size}")
    return counts


class DomainMixSampler:
    """Batches holding each domain's share by weight, each domain an endless shuffled stream of its examples."""

    def __init__(self, examples: Sequence[Example], batch_size: int, seed: int, weights: dict[str, float]) -> None:
        counts = domain_counts(batch_size, weights)
        self.samplers = {
            domain: PromptSampler([e for e in examples if e.domain == domain], counts[domain], seed + index)
            for index, domain in enumerate(sorted(counts))
        }

    def next_batch(self) -> list[Example]:
        """The next batch: each domain's rows, domain after domain."""
        return [example for sampler in self.samplers.values() for example in sampler.next_batch()]

    def state_dict(self) -> dict[str, dict[str, int]]:
        """Where each domain's stream is, for a checkpoint."""
        return {domain: sampler.state_dict() for domain, sampler in self.samplers.items()}

    def load_state_dict(self, state: dict[str, dict[str, int]]) -> None:
        """Continue every domain's stream from a checkpointed position."""
        for domain, sampler in self.samplers.items():
            sampler.load_state_dict(state[domain])


def make_sampler(
    examples: Sequence[Example], batch_size: int, seed: int, weights: dict[str, float]
) -> PromptSampler | DomainMixSampler:
    """The training batches: mixed by domain `weights` when given, else drawn from all examples alike."""
    if weights:
        return DomainMixSampler(examples, batch_size, seed, weights)
    return PromptSampler(examples, batch_size, seed)


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id used for padding (the EOS id when the tokenizer has no pad token)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def encode_demonstrations(examples: Sequence[Example], pad_id: int) -> DataProto:
    """Prompts (left-padded) followed by their demonstrated responses (right-padded), for supervised training.

    The layout matches a rollout: `prompts`, `responses`, `response_mask`, `input_ids`, `attention_mask`;
    only the response (the assistant's part) is in `response_mask`, so only it carries the loss.
    """
    prompts = encode_prompts(examples, pad_id)
    responses, response_mask = _pad([e.response_ids for e in examples], pad_id, left=False)
    prompt_ids, prompt_mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    tensors = {
        "prompts": prompt_ids,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=prompts.non_tensor_batch)
