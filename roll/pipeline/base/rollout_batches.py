"""Putting rollouts together: batches generated from prompt batches of different widths, concatenated."""

from __future__ import annotations

import torch

from roll.distributed.scheduler.protocol import DataProto


def widen_prompts(batch: DataProto, width: int, pad_id: int) -> DataProto:
    """A rollout's prompt columns left-padded to `width` (`prompts`, and the prompt part of `input_ids` and
    `attention_mask`), so rollouts generated from different prompt batches concatenate."""
    data = batch.batch
    extra = width - data["prompts"].shape[1]
    if extra <= 0:
        return batch
    tensors = dict(data.items())
    for key, value in (("prompts", pad_id), ("input_ids", pad_id), ("attention_mask", 0)):
        tensors[key] = torch.nn.functional.pad(data[key], (extra, 0), value=value)
    return DataProto.from_dict(tensors=tensors, non_tensors=batch.non_tensor_batch, meta_info=batch.meta_info)


def concat_rollouts(parts: list[DataProto], pad_id: int) -> DataProto:
    """`parts` one after the other, their prompts left-padded to the widest."""
    width = max(part.batch["prompts"].shape[1] for part in parts)
    return DataProto.concat([widen_prompts(part, width, pad_id) for part in parts])
