"""What the configs of pipelines trained on preference data share: the data format and the checks of training on it
(schedule, lengths, checkpoints and export are `TrainingRunConfig`'s)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from roll.configs.data_config import FORMAT_FIELDS, ROWS_PER_EXAMPLE, PreferenceDataArguments
from roll.configs.schema import ConfigError
from roll.configs.worker_config import WorkerConfig
from roll.models.hub import parse_hub_ref
from roll.models.tiny import TINY_SCHEME
from roll.pipeline.base.pipeline_config import checked_tokenizer
from roll.pipeline.base.training_config import TrainingRunConfig

# What one training example of each data format is called in messages.
EXAMPLE_NOUNS = {"pairs": "pairs", "unpaired": "labelled completions", "steps": "step-labelled responses"}


@dataclass
class PreferenceRunConfig(TrainingRunConfig):
    """A training run on batches of `batch_size` preference examples (pairs, two rows each: chosen and rejected;
    labelled completions or step-labelled responses, one row each: `data.format`), evaluated on held-out ones (the
    base of the DPO and reward-model configs)."""

    data: PreferenceDataArguments = field(default_factory=PreferenceDataArguments)

    def check_pretrain_written(self, why: str, command: str, run: str) -> None:
        """A missing `pretrain` directory is most often an earlier run's export not written yet: say `why` it is
        needed and that `command` writes it (to <output_dir>/<run>/model)."""
        path = self.pretrain
        local = path and not path.startswith(TINY_SCHEME) and parse_hub_ref(path) is None  # a hub id is fetched later
        if local and not Path(path).is_dir():
            raise ConfigError(
                f"pretrain={path!r} does not exist: {why} (`{command}` writes <output_dir>/{run}/model) or set "
                "pretrain to a model directory"
            )

    def rows_per_example(self) -> int:
        """The model's rows per training example: 2 for pairs (chosen and rejected), 1 otherwise."""
        return ROWS_PER_EXAMPLE[self.data.format]

    def check_format_fields(self) -> None:
        """The data fields of formats other than `data.format` keep their defaults (they would be ignored)."""
        defaults = PreferenceDataArguments()
        for data_format, names in FORMAT_FIELDS.items():
            for name in names:
                value = getattr(self.data, name)
                if data_format != self.data.format and value != getattr(defaults, name):
                    raise ConfigError(
                        f"data.{name}={value!r} applies to data.format={data_format} only, not "
                        f"{self.data.format}; leave it out"
                    )

    def check_example_training(self, name: str, role: WorkerConfig) -> None:
        """Role `name` trains, every micro-batch holds whole examples (a pair's two rows together), and one
        optimizer step is `batch_size` examples."""
        self.check_trains(name, role)
        args, rows = role.training_args, self.rows_per_example()
        if args.per_device_train_batch_size % rows:
            raise ConfigError(
                f"{name}.training_args.per_device_train_batch_size={args.per_device_train_batch_size} must be "
                "even: a micro-batch holds whole pairs (a chosen and a rejected row each)"
            )
        if role.max_tokens_per_microbatch is not None:
            raise ConfigError(
                f"{name}.max_tokens_per_microbatch must be null: a token budget regroups (or packs) rows into "
                "micro-batches of unequal size (splitting a pair's rows), and the loss averages each micro-batch alike"
            )
        step_rows = args.per_device_train_batch_size * args.gradient_accumulation_steps * role.dp_size
        if rows * self.batch_size != step_rows:
            raise ConfigError(
                f"batch_size={self.batch_size} {EXAMPLE_NOUNS[self.data.format]} are {rows * self.batch_size} "
                f"rows, which must equal {name} per_device_train_batch_size x gradient_accumulation_steps x "
                f"dp size = {step_rows}"
            )

    def check_inputs(self, roles: list[WorkerConfig]) -> None:
        """The roles' models parse and fit the examples' lengths, the data reads with the first role's tokenizer,
        and a `resume_from_checkpoint` names a complete checkpoint."""
        self.check_models_and_lengths(roles)
        self.check_examples(roles[0].model_args.model_name_or_path)
        self.check_resume()

    def check_examples(self, model_path: str) -> None:
        """The data read as the pipeline reads it in `data.format`, with `model_path`'s tokenizer (the data files, or
        the built-in examples: their rows, chat template and lengths); training holds one batch of examples, and
        held-out labelled completions hold both labels (the held-out accuracy compares them)."""
        # Imported here: `datasets` takes seconds to import, and only validation and the driver read data.
        from roll.datasets.preference_formats import load_format_splits
        from roll.datasets.unpaired_dataset import require_both_labels

        data, noun = self.data, EXAMPLE_NOUNS[self.data.format]
        train, held_out = load_format_splits(data, checked_tokenizer(model_path), self.max_response_length)
        source = f"data.train_file={data.train_file!r}" if data.train_file else f"the built-in arithmetic {noun}"
        if self.batch_size > len(train):
            raise ConfigError(
                f"batch_size={self.batch_size} is more than the {len(train)} training {noun} of {source}; "
                f"lower batch_size or add {noun}"
            )
        if data.format == "unpaired":
            evaluated = held_out[: self.eval_batch_size or None]
            source = f"data.eval_file={data.eval_file!r}" if data.eval_file else "the built-in held-out completions"
            labels = torch.tensor([example.desirable for example in evaluated])
            require_both_labels(labels, f"{source} (eval_batch_size={self.eval_batch_size})")
