"""Config checks of the token budget: it holds the longest possible sequence; packing without one gets a default."""

from __future__ import annotations

import pytest

from roll.configs.schema import ConfigError
from tests.unit.test_config_validation import rlvr, sft

BUDGETED = ("actor_train", "reference")  # the default RLVR job's roles with a token budget


def test_a_budget_below_the_longest_sequence_names_the_budget_and_the_length_fields() -> None:
    config = rlvr()
    tokens = config.data.max_prompt_length + config.actor_infer.generating_args.max_new_tokens
    with pytest.raises(ConfigError) as error:
        rlvr(f"actor_train.max_tokens_per_microbatch={tokens - 1}")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"actor_train.max_tokens_per_microbatch={tokens - 1} is less than")
    assert f"data.max_prompt_length={config.data.max_prompt_length} + " in message
    assert f"actor_infer.generating_args.max_new_tokens={config.actor_infer.generating_args.max_new_tokens}" in message
    assert rlvr(f"actor_train.max_tokens_per_microbatch={tokens}").actor_train.max_tokens_per_microbatch == tokens


def test_sft_names_its_own_length_fields() -> None:
    pattern = (
        r"actor_train.max_tokens_per_microbatch=2 is less than .* data.max_prompt_length=\d+ \+ max_response_length="
    )
    with pytest.raises(ConfigError, match=pattern):
        sft("actor_train.max_tokens_per_microbatch=2")


def test_packing_without_a_budget_packs_the_tokens_of_the_largest_padded_micro_batch() -> None:
    config = rlvr("reference.sequence_packing=true", *(f"{r}.max_tokens_per_microbatch=null" for r in BUDGETED))
    tokens = config.data.max_prompt_length + config.actor_infer.generating_args.max_new_tokens
    reference = config.reference
    rows = max(reference.training_args.per_device_train_batch_size, reference.infer_batch_size)
    assert reference.max_tokens_per_microbatch == rows * tokens
    assert config.actor_train.max_tokens_per_microbatch is None  # other roles keep fixed-size micro-batches


def test_the_default_job_forms_micro_batches_by_tokens() -> None:
    config = rlvr()
    longest = config.data.max_prompt_length + config.actor_infer.generating_args.max_new_tokens
    args = config.actor_train.training_args
    for role in BUDGETED:
        # An optimizer step's rows a rank fit one micro-batch even at the longest possible length.
        assert getattr(config, role).max_tokens_per_microbatch >= (
            args.per_device_train_batch_size * args.gradient_accumulation_steps * longest
        )


def test_budget_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"actor_train.max_tokens_per_microbatch=0 is out of range: it must be >= 1"):
        rlvr("actor_train.max_tokens_per_microbatch=0")
