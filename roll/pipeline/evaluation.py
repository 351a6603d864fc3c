"""Held-out accuracy: greedy answers to problems, scored like training rewards."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from transformers import PreTrainedTokenizerBase

from roll.configs.worker_config import GeneratingArguments
from roll.datasets.arithmetic import Problem
from roll.datasets.prompt_dataset import encode_prompts
from roll.distributed.executor.cluster import Cluster
from roll.distributed.scheduler.protocol import DataProto

Scorer = Callable[[DataProto], torch.Tensor]


def greedy_accuracy(
    cluster: Cluster,
    problems: Sequence[Problem],
    tokenizer: PreTrainedTokenizerBase,
    generating_args: GeneratingArguments,
    max_prompt_length: int,
    score: Scorer,
) -> tuple[float, DataProto]:
    """Fraction of `problems` whose greedy response scores 1, and the scored responses."""
    prompts = encode_prompts(problems, tokenizer, max_prompt_length)
    padded, pad = prompts.pad_to_divisor(cluster.world_size)
    greedy = replace(generating_args, do_sample=False, num_return_sequences=1)
    responses = cluster.generate(padded, greedy).unpad(pad)
    scores = score(responses)
    return (scores >= 1.0).float().mean().item(), responses.union(DataProto.from_dict(tensors={"scores": scores}))
