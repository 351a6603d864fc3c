"""Preference-style training data by `data.format`: how each format's splits load and a batch of its examples encodes.

pairs: `PreferencePair`s, two rows each (chosen, rejected); unpaired: `LabelledExample`s and steps:
`StepExample`s, one row each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from roll.configs.data_config import PreferenceDataArguments
from roll.datasets.preference_dataset import encode_pairs, load_preference_splits
from roll.datasets.step_dataset import encode_steps, load_step_splits
from roll.datasets.unpaired_dataset import encode_labelled, load_unpaired_splits
from roll.distributed.scheduler.protocol import DataProto

Loader = Callable[[PreferenceDataArguments, PreTrainedTokenizerBase, int], tuple[list[Any], list[Any]]]
Encoder = Callable[[Sequence[Any], int], DataProto]
FORMATS: dict[str, tuple[Loader, Encoder]] = {
    "pairs": (load_preference_splits, encode_pairs),
    "unpaired": (load_unpaired_splits, encode_labelled),
    "steps": (load_step_splits, encode_steps),
}


def load_format_splits(
    data: PreferenceDataArguments, tokenizer: PreTrainedTokenizerBase, max_response_length: int
) -> tuple[list[Any], list[Any]]:
    """Train and held-out examples of `data.format`, from the data files or built from the arithmetic task."""
    return FORMATS[data.format][0](data, tokenizer, max_response_length)


def encode_examples(examples: Sequence[Any], data_format: str, pad_id: int) -> DataProto:
    """A batch of `data_format`'s examples as the rows a model scores (a pair is two rows: chosen, rejected)."""
    return FORMATS[data_format][1](examples, pad_id)
