"""Prompt datasets: the synthetic arithmetic task or a JSONL file, batched into DataProtos."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from roll.datasets.arithmetic import Problem, arithmetic_problems
from roll.distributed.scheduler.protocol import DataProto


def load_problems(path: str) -> list[Problem]:
    """Problems from a JSONL file with `prompt` and `answer` fields (and an optional `domain`)."""
    problems = []
    with open(path) as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                problems.append(
                    Problem(str(record["prompt"]), str(record["answer"]), str(record.get("domain", "math")))
                )
            except (json.JSONDecodeError, KeyError) as exc:
                raise ValueError(
                    f"{path}:{line_number}: expected a JSON object with 'prompt' and 'answer' ({exc})"
                ) from exc
    if not problems:
        raise ValueError(f"{path} holds no problems")
    return problems


def task_problems(train_file: str, eval_file: str, seed: int) -> tuple[list[Problem], list[Problem]]:
    """Train and held-out problems: from the given files, else the built-in arithmetic task."""
    if bool(train_file) != bool(eval_file):
        raise ValueError("give both data.train_file and data.eval_file, or neither for the built-in arithmetic task")
    if train_file:
        return load_problems(train_file), load_problems(eval_file)
    return arithmetic_problems(seed=seed)


def encode_prompts(
    problems: Sequence[Problem], tokenizer: PreTrainedTokenizerBase, max_prompt_length: int
) -> DataProto:
    """Left-padded prompt ids and masks, with the prompt text, answer and domain per row."""
    encoded = tokenizer([p.prompt for p in problems], padding=True, return_tensors="pt", add_special_tokens=False)
    if encoded["input_ids"].shape[1] > max_prompt_length:
        longest = max(problems, key=lambda p: len(p.prompt)).prompt
        raise ValueError(f"prompt {longest!r} is longer than data.max_prompt_length={max_prompt_length} tokens")
    return DataProto.from_dict(
        tensors={"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]},
        non_tensors={
            "prompt": [p.prompt for p in problems],
            "answer": [p.answer for p in problems],
            "domain": [p.domain for p in problems],
        },
    )


class PromptSampler:
    """Endless shuffled batches of problems; its position is part of a checkpoint."""

    def __init__(self, problems: Sequence[Problem], batch_size: int, seed: int) -> None:
        if batch_size > len(problems):
            raise ValueError(f"batch size {batch_size} is larger than the {len(problems)} training problems")
        self.problems = list(problems)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.problems)))
        random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[Problem]:
        """The next `batch_size` problems; a new shuffled epoch starts when fewer remain."""
        if self.position + self.batch_size > len(self._order):
            self.epoch += 1
            self.position = 0
            self._order = self._shuffled(self.epoch)
        indices = self._order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return [self.problems[i] for i in indices]

    def state_dict(self) -> dict[str, int]:
        """Where the sampler is, for a checkpoint."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a checkpointed position."""
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._shuffled(self.epoch)


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id used for padding (the EOS id when the tokenizer has no pad token)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def encode_demonstrations(
    problems: Sequence[Problem], tokenizer: PreTrainedTokenizerBase, max_prompt_length: int, max_response_length: int
) -> DataProto:
    """Prompts (left-padded) followed by their answers and EOS (right-padded), for supervised training.

    The layout matches a rollout: `prompts`, `responses`, `response_mask`, `input_ids`, `attention_mask`.
    """
    prompts = encode_prompts(problems, tokenizer, max_prompt_length)
    answers = [tokenizer(p.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for p in problems]
    if max(len(a) for a in answers) > max_response_length:
        raise ValueError(f"an answer is longer than max_response_length={max_response_length} tokens")
    width = max(len(a) for a in answers)
    pad = pad_token_id(tokenizer)
    responses = torch.tensor([a + [pad] * (width - len(a)) for a in answers])
    response_mask = torch.tensor([[1] * len(a) + [0] * (width - len(a)) for a in answers])
    prompt_ids, prompt_mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    tensors = {
        "prompts": prompt_ids,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=prompts.non_tensor_batch)
