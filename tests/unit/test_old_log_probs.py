"""Old log-probs taken from the update's own forward pass equal a separate pass's: same loss, gradients, KL metric."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from roll.configs.algorithm_config import AlgorithmArguments
from roll.configs.worker_config import TrainingArguments
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.hf_compute import forward_in_micro_batches, model_inputs
from roll.distributed.strategy.strategy import InferenceStrategy
from roll.pipeline.base.rl_workers import ActorWorker
from roll.pipeline.rlvr.rollout import compute_advantages

ROWS, PROMPT, RESPONSE, VOCAB = 8, 3, 5, 16
MICRO, ACCUMULATION = 2, 4  # one optimizer step of 8 rows, like actor_train on one rank


class GradientStrategy:
    """A training strategy without the optimizer step: forward/backward per micro-batch, gradients kept.

    The loss of each micro-batch is divided by the accumulation steps, as DeepSpeed does; forward passes
    (the separate old log-probs pass) go through the real hf_compute path, in eval mode and without grad.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    response_log_probs = InferenceStrategy.response_log_probs  # what ActorWorker.compute_log_probs calls

    def forward_step(self, batch: DataProto, forward_func: Any) -> dict[str, torch.Tensor]:
        return forward_in_micro_batches(self.model, batch, forward_func, ROWS, "cpu")

    def train_step(self, batch: DataProto, loss_func: Any) -> dict[str, float]:
        self.model.train()
        self.model.zero_grad()
        sums: dict[str, float] = {"loss": 0.0}
        micro_batches = batch.split(MICRO)
        for micro_batch in micro_batches:
            output = self.model(**model_inputs(micro_batch, "cpu"), use_cache=False)
            loss, metrics = loss_func(micro_batch, output)
            (loss / len(micro_batches)).backward()
            sums["loss"] += loss.item() / len(micro_batches)
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value.float().mean().item() / len(micro_batches)
        return sums

    def gradients(self) -> dict[str, torch.Tensor]:
        return {name: p.grad.clone() for name, p in self.model.named_parameters() if p.grad is not None}


def tiny_model() -> torch.nn.Module:
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(torch.float32)


def rollout() -> DataProto:
    """Left-padded prompts and right-padded responses of varied lengths, one empty; mixed-sign advantages."""
    generator = torch.Generator().manual_seed(1)
    prompt_mask = torch.ones(ROWS, PROMPT, dtype=torch.long)
    prompt_mask[::3, 0] = 0
    lengths = torch.tensor([5, 3, 1, 0, 4, 5, 2, 5])
    response_mask = (torch.arange(RESPONSE) < lengths[:, None]).long()
    prompts = torch.randint(1, VOCAB, (ROWS, PROMPT), generator=generator) * prompt_mask
    responses = torch.randint(1, VOCAB, (ROWS, RESPONSE), generator=generator) * response_mask
    return DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
            "advantages": torch.randn(ROWS, RESPONSE, generator=generator) * response_mask,
            "ref_log_probs": -2.0 + 0.5 * torch.randn(ROWS, RESPONSE, generator=generator),
            "scores": torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]),
        }
    )


def worker(model: torch.nn.Module) -> SimpleNamespace:
    args = TrainingArguments(per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUMULATION)
    return SimpleNamespace(
        strategy=GradientStrategy(model), worker_config=SimpleNamespace(training_args=args), compute_seconds=0.0
    )


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_update_log_probs_as_old_log_probs_give_the_loss_and_gradients_of_a_separate_pass(
    agg_mode: str, dual_clip: float | None
) -> None:
    algorithm = AlgorithmArguments(
        loss_agg_mode=agg_mode,
        dual_clip=dual_clip,
        use_kl_loss=True,
        kl_loss_coef=0.04,
        entropy_coef=0.01,
        clip_low=0.2,
        clip_high=0.28,
    )
    separate = worker(tiny_model())
    old = ActorWorker.compute_log_probs(separate, rollout()).batch["log_probs"]
    with_pass = rollout().union(DataProto.from_dict(tensors={"old_log_probs": old}))
    expected = ActorWorker.train_step(separate, with_pass, algorithm)

    same = worker(tiny_model())
    actual = ActorWorker.train_step(same, rollout(), algorithm)

    assert actual["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    expected_grads, actual_grads = separate.strategy.gradients(), same.strategy.gradients()
    assert expected_grads.keys() == actual_grads.keys() and expected_grads
    for name, grad in expected_grads.items():
        torch.testing.assert_close(actual_grads[name], grad, atol=1e-6, rtol=0, msg=name)
    # The update starts from the scoring weights: nothing clipped, ratio 1, no KL between old and new.
    assert actual["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and actual["clipfrac"] == 0.0
    assert actual["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    for key in ("ratio_mean", "clipfrac", "approx_kl", "kl_loss", "entropy"):
        assert actual[key] == pytest.approx(expected[key], abs=1e-6), key


def test_the_update_reports_the_kl_the_driver_reports_from_a_separate_pass() -> None:
    algorithm = AlgorithmArguments(use_kl_loss=True, kl_loss_coef=0.04, kl_loss_kind="k3", kl_penalty_kind="k1")
    separate = worker(tiny_model())
    old = ActorWorker.compute_log_probs(separate, rollout()).batch["log_probs"]
    with_pass = rollout().union(DataProto.from_dict(tensors={"old_log_probs": old}))
    scored = with_pass.select(batch_keys=["response_mask", "scores", "old_log_probs", "ref_log_probs"])
    _, driver_metrics = compute_advantages(scored, torch.arange(ROWS) // 4, algorithm, kl_coef=0.0)

    metrics = ActorWorker.train_step(worker(tiny_model()), rollout(), algorithm)
    assert metrics["kl"] == pytest.approx(driver_metrics["actor/kl"], abs=1e-6)
    assert "kl" not in ActorWorker.train_step(separate, with_pass, algorithm)  # the driver reports it there


def test_a_shard_of_more_than_one_optimizer_step_needs_old_log_probs() -> None:
    batch = DataProto.concat([rollout(), rollout()])
    with pytest.raises(ValueError, match="one optimizer step"):
        ActorWorker.train_step(worker(tiny_model()), batch, AlgorithmArguments())
