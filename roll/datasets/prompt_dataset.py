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
import torch
from transformers import PreTrainedTokenizerBase

from roll.configs.data_config import DataArguments, SourceArguments
from roll.configs.schema import ConfigError
from roll.datasets.arithmetic import Problem, arithmetic_problems
from roll.datasets.chat_format import format_prompt, use_chat_template
from roll.datasets.sources import quiet_progress, read_table, to_conversations
from roll.distributed.scheduler.protocol import DataProto

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


def load_splits(
    data: DataArguments, tokenizer: PreTrainedTokenizerBase, max_response_length: int | None = None
) -> tuple[list[Example], list[Example]]:
    """Train and held-out examples from `data.train_file` / `data.eval_file`, else the built-in arithmetic task.

    Rows too long for `data.max_prompt_length` (or, when given, `max_response_length`) are dropped
    or refused as `data.too_long` says.
    """
    with quiet_progress():
        tables = split_tables(data, lambda table, source: to_conversations(table, data, source), problems_table)
        train, held_out = (tokenize(table, tokenizer, data, max_response_length, source) for table, source in tables)
        return train, held_out


def split_tables(
    data: SourceArguments,
    from_file: Callable[[datasets.Dataset, str], datasets.Dataset],
    built_in: Callable[[list[Problem]], datasets.Dataset],
) -> list[tuple[datasets.Dataset, str]]:
    """(table, source) of the train and held-out splits: `data.train_file` / `data.eval_file` read and mapped by
    `from_file`, else the built-in arithmetic task's splits made into tables by `built_in`."""
    if bool(data.train_file) != bool(data.eval_file):
        given, missing = ("train_file", "eval_file") if data.train_file else ("eval_file", "train_file")
        raise ConfigError(
            f"data.{missing} is empty but data.{given} is set: give both, or neither for the built-in arithmetic task"
        )
    if data.train_file:
        sources = [f"data.{key}={getattr(data, key)!r}" for key in ("train_file", "eval_file")]
        files = (data.train_file, data.eval_file)
        return [(from_file(read_table(f, source), source), source) for f, source in zip(files, sources, strict=True)]
    splits = zip(arithmetic_problems(seed=data.task_seed), ("train", "held out"), strict=True)
    return [(built_in(problems), f"{BUILT_IN} ({name})") for problems, name in splits]


def problems_table(problems: Sequence[Problem]) -> datasets.Dataset:
    """`problems` as a table of roll's columns (a one-turn conversation each)."""
    return datasets.Dataset.from_list(
        [
            {
                "messages": [{"role": "user", "content": p.prompt}],
                "answer": p.answer,
                "demonstration": p.answer,
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
    source: str,
) -> list[Example]:
    """Examples of `table`'s rows: formatted (chat template as configured), tokenised, too-long rows handled."""
    encoded = table.map(
        encode_row,
        fn_kwargs=encode_kwargs(tokenizer, data),
        remove_columns=["messages", "demonstration"],
        desc="tokenizing",
    )
    kept = length_filtered(encoded, data, max_response_length, source, ["response_ids"])
    return [Example(**row) for row in kept.to_list()]


def encode_kwargs(tokenizer: PreTrainedTokenizerBase, data: SourceArguments) -> dict[str, Any]:
    """The keyword arguments of `encode_row` for `data`'s formatting."""
    return {
        "tokenizer": tokenizer,
        "chat_template": use_chat_template(data.apply_chat_template, tokenizer),
        "system_prompt": data.system_prompt,
    }


def length_filtered(
    encoded: datasets.Dataset,
    data: SourceArguments,
    max_response_length: int | None,
    source: str,
    response_columns: list[str],
) -> datasets.Dataset:
    """The rows of `encoded` whose prompt and `response_columns` fit the limits; the others are dropped with a
    warning or refused, as `data.too_long` says."""
    limits = {
        "max_prompt_length": data.max_prompt_length,
        "max_response_length": max_response_length,
        "response_columns": response_columns,
    }
    kept = encoded.filter(_fits, fn_kwargs=limits, desc="length filter")
    dropped = len(encoded) - len(kept)
    if dropped:
        what = f"prompts longer than data.max_prompt_length={data.max_prompt_length} tokens"
        if max_response_length is not None:
            what += f" or demonstrations longer than max_response_length={max_response_length} tokens"
        if data.too_long == "error" or not len(kept):
            first = next(row for row in encoded if not _fits(row, **limits))
            fix = "raise the limit, or set data.too_long=drop to leave them out" if len(kept) else "raise the limit"
            example = first["prompt"]
            raise ConfigError(f"{source}: {dropped} of {len(encoded)} rows have {what}, e.g. {example!r}; {fix}")
        logger.warning("%s: dropped %d of %d rows with %s", source, dropped, len(encoded), what)
    return kept


def response_ids(text: str, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The token ids of a response `text`, ending with EOS (the model learns to stop there)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


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


def _fits(
    row: dict[str, Any], max_prompt_length: int, max_response_length: int | None, response_columns: list[str]
) -> bool:
    short = max_response_length is None or all(len(row[c]) <= max_response_length for c in response_columns)
    return len(row["prompt_ids"]) <= max_prompt_length and short


def encode_prompts(examples: Sequence[Example], pad_id: int) -> DataProto:
    """Left-padded prompt ids and masks, with the prompt text, answer and domain per row."""
    ids, mask = _pad([e.prompt_ids for e in examples], pad_id, left=True)
    return DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask},
        non_tensors={
            "prompt": [e.prompt for e in examples],
            "answer": [e.answer for e in examples],
            "domain": [e.domain for e in examples],
        },
    )


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
