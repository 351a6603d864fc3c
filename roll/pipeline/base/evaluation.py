"""Held-out accuracy: greedy answers to problems, scored like training rewards."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from transformers import PreTrainedTokenizerBase

from roll.configs.worker_config import GeneratingArguments
from roll.datasets.prompt_dataset import Example, encode_prompts
from roll.datasets.responses import response_texts
from roll.distributed.executor.cluster import Cluster
from roll.distributed.scheduler.protocol import DataProto
from roll.rewards.functions import math_reward

Scorer = Callable[[DataProto], torch.Tensor]


def answer_scorer(tokenizer: PreTrainedTokenizerBase) -> Scorer:
    """Scores each generated row 1 when its decoded response is the row's `answer` (stripped), or states it as
    math_reward reads answers; else 0. The first covers answers that are not mathematics (a move, a tool call)."""

    def score(batch: DataProto) -> torch.Tensor:
        texts = response_texts(tokenizer, batch)
        answers = batch.non_tensor_batch["answer"]
        return torch.tensor(
            [
                1.0 if text.strip() == str(answer).strip() else math_reward("", text, answer)
                for text, answer in zip(texts, answers, strict=True)
            ]
        )

    return score


def greedy_accuracy(
    cluster: Cluster,
    examples: Sequence[Example],
    pad_id: int,
    generating_args: GeneratingArguments,
    score: Scorer,
) -> tuple[float, DataProto]:
    """Fraction of `examples` whose greedy response scores 1, and the scored responses.

    The prompts are formatted and tokenised as in training (`load_splits`), chat template included.
    """
    prompts = encode_prompts(examples, pad_id)
    padded, pad = prompts.pad_to_divisor(cluster.world_size)
    greedy = replace(generating_args, do_sample=False, num_return_sequences=1)
    responses = cluster.generate(padded, greedy).unpad(pad)
    scores = score(responses)
    return (scores >= 1.0).float().mean().item(), responses.union(DataProto.from_dict(tensors={"scores": scores}))
