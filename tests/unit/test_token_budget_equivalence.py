"""Token-budget and packed micro-batches give the padded computation's log-probs, values, losses and gradients.

A real tiny Qwen2 (roll.models.tiny, fp32) runs through the same planning, forward and loss-normalisation
code the DeepSpeed strategy uses (`optimizer_step_losses`, `forward_in_micro_batches`), without Ray or
DeepSpeed. The reference is the whole optimizer step as one padded micro-batch.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from roll.configs.algorithm_config import AlgorithmArguments
from roll.configs.worker_config import ModelArguments, TrainingArguments
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.hf_compute import forward_in_micro_batches, optimizer_step_losses
from roll.distributed.strategy.micro_batches import TokenBudget
from roll.distributed.strategy.strategy import InferenceStrategy
from roll.models.model_providers import ModelKind, load_model
from roll.models.tiny import TinyModelSpec, make_tiny_model
from roll.pipeline.base.rl_workers import ActorWorker, CriticWorker
from tests.padded_rollouts import padded_rollout

ROWS, PROMPT, RESPONSE = 8, 6, 7  # one optimizer step of 8 rows; the longest possible sequence is 13 tokens
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
# name -> (rows per micro-batch, accumulation steps, token budget)
LAYOUTS = {
    "padded, 2 rows x 4": (2, 4, None),
    "token budget 26": (2, 4, TokenBudget(max_tokens=26)),
    "packed 26": (2, 4, TokenBudget(max_tokens=26, packing=True)),
    "packed 13": (2, 4, TokenBudget(max_tokens=13, packing=True)),
}
ATOL = 1e-5


class LocalStrategy:
    """A train/forward strategy on a plain module: the DeepSpeed strategy's micro-batching, no optimizer step."""

    def __init__(self, model: torch.nn.Module, micro: int, budget: TokenBudget | None, step_rows: int) -> None:
        self.model, self.micro, self.budget, self.step_rows = model, micro, budget, step_rows
        self.micro_batches = 0

    response_log_probs = InferenceStrategy.response_log_probs  # what ActorWorker.compute_log_probs calls

    def forward_step(self, batch: DataProto, forward_func: Any) -> dict[str, torch.Tensor]:
        return forward_in_micro_batches(self.model, batch, forward_func, self.micro, "cpu", self.budget)

    def train_step(self, batch: DataProto, loss_func: Any) -> dict[str, float]:
        self.model.train()
        self.model.zero_grad()
        total = 0.0
        for step_batch in batch.split(self.step_rows):
            for loss, _, _ in optimizer_step_losses(self.model, step_batch, loss_func, self.micro, "cpu", self.budget):
                loss.backward()
                total += loss.item()
                self.micro_batches += 1
        return {"loss": total}

    def gradients(self) -> dict[str, torch.Tensor]:
        return {name: p.grad.clone() for name, p in self.model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = TinyModelSpec(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), spec)


def load(model_dir: Path, kind: ModelKind = "causal_lm", attn: str = "sdpa") -> torch.nn.Module:
    """The model as a role loads it (a value model: new head, no dropout), in fp32."""
    torch.manual_seed(0)  # the value head is not in the checkpoint: the same initialisation for every load
    model_args = ModelArguments(model_name_or_path=str(model_dir), dtype="fp32", attn_implementation=attn)
    return load_model(model_args, kind, trainable=True)


def worker(model: torch.nn.Module, micro: int, accumulation: int, budget: TokenBudget | None) -> SimpleNamespace:
    args = TrainingArguments(per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation)
    strategy = LocalStrategy(model, micro, budget, micro * accumulation)
    return SimpleNamespace(
        strategy=strategy,
        worker_config=SimpleNamespace(training_args=args),
        compute_seconds=0.0,
        _response_values=CriticWorker._response_values,
    )


def rollout(vocab: int) -> DataProto:
    """Prompts of 1-6 real tokens (left-padded), responses of 0-7 (right-padded), PPO and value targets."""
    prompt_lengths, response_lengths = [6, 1, 3, 5, 2, 6, 4, 1], [7, 2, 0, 5, 7, 1, 3, 6]
    tensors, generator = padded_rollout(prompt_lengths, response_lengths, (PROMPT, RESPONSE), vocab, seed=3)
    noise = lambda: torch.randn(ROWS, RESPONSE, generator=generator)  # noqa: E731
    tensors.update(
        advantages=noise() * tensors["response_mask"],
        old_log_probs=-4.5 + 0.3 * noise(),  # far enough from the model's to clip some tokens
        ref_log_probs=-4.5 + 0.3 * noise(),
        values=0.1 * noise(),
        returns=noise(),
    )
    return DataProto.from_dict(tensors=tensors)


def reference(model_dir: Path, kind: ModelKind = "causal_lm") -> SimpleNamespace:
    return worker(load(model_dir, kind), ROWS, 1, None)


def assert_same_gradients(expected: SimpleNamespace, actual: SimpleNamespace) -> None:
    expected_grads, actual_grads = expected.strategy.gradients(), actual.strategy.gradients()
    assert expected_grads.keys() == actual_grads.keys() and expected_grads
    for name, grad in expected_grads.items():
        torch.testing.assert_close(actual_grads[name], grad, atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_log_probs_equal_the_padded_pass_in_row_order(model_dir: Path, layout: str, attn: str) -> None:
    batch = rollout(load(model_dir).config.vocab_size)
    mask = batch.batch["response_mask"].bool()
    expected = ActorWorker.compute_log_probs(worker(load(model_dir, attn=attn), ROWS, 1, None), batch)
    actual = ActorWorker.compute_log_probs(worker(load(model_dir, attn=attn), *LAYOUTS[layout]), batch)
    assert actual.batch["log_probs"].shape == (ROWS, RESPONSE)
    torch.testing.assert_close(actual.batch["log_probs"][mask], expected.batch["log_probs"][mask], atol=ATOL, rtol=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_actor_loss_and_gradients_equal_the_padded_step(model_dir: Path, layout: str, mode: str) -> None:
    algorithm = AlgorithmArguments(
        loss_agg_mode=mode, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01, clip_low=0.2, clip_high=0.28
    )
    batch = rollout(load(model_dir).config.vocab_size)
    expected_worker, actual_worker = reference(model_dir), worker(load(model_dir), *LAYOUTS[layout])
    expected = ActorWorker.train_step(expected_worker, batch, algorithm)
    actual = ActorWorker.train_step(actual_worker, batch, algorithm)
    assert actual_worker.strategy.micro_batches > 1  # the step really was split
    assert actual["loss"] == pytest.approx(expected["loss"], abs=ATOL)
    assert_same_gradients(expected_worker, actual_worker)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_critic_values_loss_and_gradients_equal_the_padded_step(model_dir: Path, layout: str, mode: str) -> None:
    algorithm = AlgorithmArguments(loss_agg_mode=mode, value_clip=0.05)
    batch = rollout(load(model_dir).config.vocab_size)
    mask = batch.batch["response_mask"].bool()
    expected_worker, actual_worker = reference(model_dir, "value"), worker(load(model_dir, "value"), *LAYOUTS[layout])
    values = CriticWorker.compute_values(actual_worker, batch).batch["values"]
    expected_values = CriticWorker.compute_values(expected_worker, batch).batch["values"]
    torch.testing.assert_close(values[mask], expected_values[mask], atol=ATOL, rtol=0)
    expected = CriticWorker.train_step(expected_worker, batch, algorithm)
    actual = CriticWorker.train_step(actual_worker, batch, algorithm)
    assert actual["loss"] == pytest.approx(expected["loss"], abs=ATOL)
    assert_same_gradients(expected_worker, actual_worker)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sft_loss_and_gradients_equal_the_padded_step(model_dir: Path, layout: str) -> None:
    batch = rollout(load(model_dir).config.vocab_size)
    expected_worker, actual_worker = reference(model_dir), worker(load(model_dir), *LAYOUTS[layout])
    expected = ActorWorker.sft_step(expected_worker, batch)
    actual = ActorWorker.sft_step(actual_worker, batch)
    assert actual["loss"] == pytest.approx(expected["loss"], abs=ATOL)
    assert_same_gradients(expected_worker, actual_worker)


def test_two_optimizer_steps_are_normalised_each_over_their_own_rows(model_dir: Path) -> None:
    """Each step's micro-batches are planned within its rows: per-step losses add up as two whole-step passes."""
    algorithm = AlgorithmArguments(loss_agg_mode="token-mean")
    batch = rollout(load(model_dir).config.vocab_size)
    halves = [batch[:4], batch[4:]]
    expected = sum(
        ActorWorker.train_step(worker(load(model_dir), 4, 1, None), half, algorithm)["loss"] for half in halves
    )
    packed = worker(load(model_dir), 1, 4, TokenBudget(max_tokens=13, packing=True))
    assert ActorWorker.train_step(packed, batch, algorithm)["loss"] == pytest.approx(expected, abs=ATOL)
