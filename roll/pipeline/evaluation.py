"""Held-out accuracy: greedy answers to problems, scored like training rewards."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from roll.configs.worker_config import GeneratingArguments
from roll.datasets.prompt_dataset import Example, encode_prompts
from roll.distributed.executor.cluster import Cluster
from roll.distributed.scheduler.protocol import DataProto

Scorer = Callable[[DataProto], torch.Tensor]


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
