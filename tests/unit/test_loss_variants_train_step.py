"""The loss variants inside ActorWorker: the rollout carries the engine's log-probs, the update uses them and
the Dr. GRPO constant, and token-budget micro-batches still give the padded step's loss and gradients."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from roll.configs.algorithm_config import AlgorithmArguments
from roll.configs.worker_config import GeneratingArguments
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.strategy import Generation
from roll.pipeline.base.rl_workers import MAX_RESPONSE_LENGTH, WITH_ENGINE_LOG_PROBS, ActorWorker
from tests.unit.test_token_budget_equivalence import (
    ATOL,
    LAYOUTS,
    RESPONSE,
    assert_same_gradients,
    load,
    model_dir,  # noqa: F401 (the fixture)
    reference,
    rollout,
    worker,
)


def variant_rollout(vocab: int, engine_shift: torch.Tensor | float) -> DataProto:
    """The token-budget tests' rollout with engine log-probs `old - engine_shift` and the max response length."""
    batch = rollout(vocab)
    batch.batch["engine_log_probs"] = batch.batch["old_log_probs"] - engine_shift
    batch.meta_info[MAX_RESPONSE_LENGTH] = RESPONSE
    return batch


@pytest.mark.parametrize("layout", ["token budget 26", "packed 13"])
def test_variants_equal_the_padded_step(model_dir: Path, layout: str) -> None:  # noqa: F811
    """Dr. GRPO's constant comes from meta_info, not the (trimmed) micro-batch width; GSPO and TIS are per row."""
    algorithm = AlgorithmArguments(
        loss_agg_mode="seq-mean-token-sum-norm",
        importance_level="sequence",
        tis_cap=1.2,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        entropy_coef=0.01,
    )
    shift = 0.3 * torch.randn(8, RESPONSE, generator=torch.Generator().manual_seed(5))
    batch = variant_rollout(load(model_dir).config.vocab_size, shift)
    expected_worker, actual_worker = reference(model_dir), worker(load(model_dir), *LAYOUTS[layout])
    expected = ActorWorker.train_step(expected_worker, batch, algorithm)
    actual = ActorWorker.train_step(actual_worker, batch, algorithm)
    assert actual_worker.strategy.micro_batches > 1
    assert actual["loss"] == pytest.approx(expected["loss"], abs=ATOL)
    assert_same_gradients(expected_worker, actual_worker)


def test_tis_scales_the_policy_loss_by_the_engine_ratio(model_dir: Path) -> None:  # noqa: F811
    """Engine log-probs 0.5 above the old ones: every weight is e^-0.5 (under the cap), so the loss is e^-0.5 times."""
    vocab = load(model_dir).config.vocab_size
    plain = ActorWorker.train_step(reference(model_dir), variant_rollout(vocab, 0.0), AlgorithmArguments())
    weighted = ActorWorker.train_step(
        reference(model_dir), variant_rollout(vocab, -0.5), AlgorithmArguments(tis_cap=2.0)
    )
    assert weighted["loss"] == pytest.approx(math.exp(-0.5) * plain["loss"], rel=1e-5)


class EngineStub:
    """generate_with_log_probs of an engine: fixed ids, log-probs -1, -2, ... (0 at padding, as the engines pad)."""

    def generate_with_log_probs(self, batch: DataProto, args: GeneratingArguments) -> Generation:
        output = torch.tensor([[1, 2, 5, 6, 0], [1, 2, 5, 0, 0]])  # prompt [1, 2]; EOS 0 = pad
        log_probs = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -2.0, 0.0]])
        return Generation(output, torch.tensor([3, 2]), torch.tensor([False, False]), log_probs)


def test_generate_carries_the_engine_log_probs_when_asked() -> None:
    """The rollout gets `engine_log_probs` masked like the response (EOS kept, padding 0)."""
    fake = SimpleNamespace(strategy=EngineStub(), compute_seconds=0.0)
    fake.to_rollout = partial(ActorWorker.to_rollout, fake)
    prompts = DataProto.from_dict(
        tensors={"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.ones(1, 2, dtype=torch.long)},
        meta_info={WITH_ENGINE_LOG_PROBS: True},
    )
    rollout_batch = ActorWorker.generate(fake, prompts, GeneratingArguments(max_new_tokens=3, num_return_sequences=2))
    assert rollout_batch.batch["response_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert rollout_batch.batch["engine_log_probs"].tolist() == [[-1.0, -2.0, -3.0], [-1.0, -2.0, 0.0]]
