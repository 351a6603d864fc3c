"""The preference data of a training run (`roll.pipeline.base.training_loop` holds the loop: steps, held-out
evaluation, checkpoints, resume, export).

A subclass (DPO, the reward model) starts its clusters and supplies one step, the held-out
evaluation and how their numbers are shown.
"""

from __future__ import annotations

from roll.datasets.preference_formats import encode_examples, load_format_splits
from roll.datasets.prompt_dataset import PromptSampler, pad_token_id
from roll.distributed.scheduler.protocol import DataProto
from roll.models.model_providers import load_tokenizer
from roll.pipeline.base.preference_config import PreferenceRunConfig
from roll.pipeline.base.training_loop import TrainingRunPipeline


class PreferenceRunPipeline(TrainingRunPipeline):
    """Trains `trained_role` on batches of preference examples (`data.format`) with the shared training loop."""

    config: PreferenceRunConfig

    def __init__(self, config: PreferenceRunConfig) -> None:
        super().__init__(config)
        tokenizer = load_tokenizer(config.roles()[self.trained_role].model_args.model_name_or_path)
        self.pad_id = pad_token_id(tokenizer)
        train, held_out = load_format_splits(config.data, tokenizer, config.max_response_length)
        self.sampler = PromptSampler(train, config.batch_size, config.seed)
        self.eval_batch = self.encode(held_out[: config.eval_batch_size or None])

    def encode(self, examples: list) -> DataProto:
        """`examples` of `data.format` as the rows the models score (a pair is two rows: chosen, rejected)."""
        return encode_examples(examples, self.config.data.format, self.pad_id)
