"""Responses decoded to text, apart from the data loaders: a reward worker decodes and reads no data file, so
it does not import `datasets` (with pandas and pyarrow, a second or two of imports in every such process)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from roll.distributed.scheduler.protocol import DataProto


def response_texts(tokenizer: PreTrainedTokenizerBase, batch: DataProto) -> list[str]:
    """Each row's response decoded from the tokens its `response_mask` covers, special tokens (EOS) dropped.

    The mask, not a pad id, says where a response ends: the padding after it is the generating engine's
    pad id, which may be an EOS or not this tokenizer's pad.
    """
    responses, mask = batch.batch["responses"], batch.batch["response_mask"].bool()
    rows = [row[keep].tolist() for row, keep in zip(responses, mask, strict=True)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)
