"""Rollout tensors from generations, and forward passes that never run with dropout."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.hf_compute import forward_in_micro_batches
from roll.pipeline.base_worker import LOG_PROB_TEMPERATURE, ActorWorker, split_generation

EOS = PAD = 0


def test_prompt_mask_is_carried_not_rebuilt_from_the_pad_id() -> None:
    # Left-padded prompt [PAD, 5, EOS, 6]: its EOS (a chat template's turn end, pad = eos) is attended.
    prompt_mask = torch.tensor([[0, 1, 1, 1]])
    output = torch.tensor([[PAD, 5, EOS, 6, 7, EOS, PAD]])
    tensors = split_generation(output, prompt_mask, EOS, PAD)
    assert tensors["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 1, 0]]
    assert tensors["response_mask"].tolist() == [[1, 1, 0]]
    assert tensors["input_ids"].tolist() == output.tolist()


class DropoutLM(torch.nn.Module):
    """Logits through a dropout layer: different on every call in train mode."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 8)
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, input_ids: torch.Tensor, **_: object) -> SimpleNamespace:
        return SimpleNamespace(logits=self.dropout(self.embed(input_ids)))


def test_forward_passes_run_in_eval_mode_after_training() -> None:
    model = DropoutLM().train()  # as a training strategy leaves it after an update
    batch = DataProto.from_dict(
        tensors={"input_ids": torch.arange(8).reshape(2, 4), "attention_mask": torch.ones(2, 4)}
    )

    def logits(micro_batch: DataProto, output: SimpleNamespace) -> tuple[None, dict[str, torch.Tensor]]:
        return None, {"logits": output.logits}

    first = forward_in_micro_batches(model, batch, logits, 1, "cpu")["logits"]
    second = forward_in_micro_batches(model, batch, logits, 2, "cpu")["logits"]
    assert torch.equal(first, second)
    assert torch.equal(first, model.embed(batch.batch["input_ids"]).detach())


class _FixedLogitsStrategy:
    """Runs the worker's forward function on fixed logits: token 1 three times as likely as token 0."""

    def forward_step(self, batch: DataProto, forward_func: Any) -> dict[str, torch.Tensor]:
        logits = torch.tensor([0.0, math.log(3.0)]).expand(*batch.batch["input_ids"].shape, 2)
        return forward_func(batch, SimpleNamespace(logits=logits))[1]


@pytest.mark.parametrize(("temperature", "p_token1"), [(1.0, 0.75), (2.0, math.sqrt(3) / (1 + math.sqrt(3)))])
def test_log_probs_are_taken_at_the_batch_log_prob_temperature(temperature: float, p_token1: float) -> None:
    batch = DataProto.from_dict(
        tensors={"input_ids": torch.tensor([[0, 1, 1]]), "responses": torch.tensor([[1, 1]])},
        meta_info={LOG_PROB_TEMPERATURE: temperature},
    )
    worker = SimpleNamespace(strategy=_FixedLogitsStrategy(), compute_seconds=0.0)
    log_probs = ActorWorker.compute_log_probs(worker, batch).batch["log_probs"]
    torch.testing.assert_close(log_probs, torch.full((1, 2), math.log(p_token1)))
