"""Reward clusters that score responses with a trained reward model (a scalar head on a backbone).

Selected in RLVR by `rewards.<key>.worker_cls`, with the exported model (`roll-rm`) as the cluster's
`model_args.model_name_or_path` and an inference strategy (hf_infer): an outcome reward model scores a
whole response (`RewardModelWorker`), a process reward model each of its steps (`ProcessRewardScoringWorker`).
They read the same token ids the policy generated, so the model must share the policy's tokenizer.
"""

from __future__ import annotations

from typing import Any

import torch

from roll.algorithms.process_reward_losses import step_rewards
from roll.datasets.responses import response_texts
from roll.datasets.step_dataset import response_step_ends, separator_ids
from roll.distributed.executor.strategy_worker import StrategyWorker
from roll.distributed.scheduler.decorator import Dispatch, register
from roll.distributed.scheduler.protocol import DataProto
from roll.models.model_providers import ModelKind


def sequence_scores(output: Any) -> torch.Tensor:
    """The scalar score per row of a sequence-classification output with one label: `[B]`.

    transformers reads it at each row's last non-pad token (responses are right-padded).
    """
    return output.logits[:, 0].float()


def response_scores(output: Any, response_length: int) -> torch.Tensor:
    """The score at each response token `[B, R]` of a token-classification output with one label, read at the token
    itself (a step is scored once its separator has been read)."""
    return output.logits[:, -response_length:, 0].float()


def step_end_mask(responses: torch.Tensor, lengths: torch.Tensor, separator: list[int]) -> torch.Tensor:
    """1 at the last token of each step of each response `[B, R]` (`response_step_ends` over its first `lengths`
    tokens: a closing EOS after a separator is a step of its own, as the PRM's training data scores it), 0
    elsewhere."""
    mask = torch.zeros(responses.shape, dtype=torch.long)
    for i, (row, length) in enumerate(zip(responses.tolist(), lengths.tolist(), strict=True)):
        mask[i, response_step_ends(row[:length], separator)] = 1
    return mask


class RewardModelWorker(StrategyWorker):
    """Scores `[prompt | response]` rows with a reward model: `compute_scores`, and RLVR's `compute_rewards`."""

    model_kind: ModelKind = "reward"

    @register(Dispatch.DP_COMPUTE)
    def compute_scores(self, batch: DataProto) -> DataProto:
        """The reward model's score of each row's `input_ids` / `attention_mask`: `scores` `[B]`."""
        return DataProto.from_dict(tensors={"scores": self._scores(batch)})

    @register(Dispatch.DP_COMPUTE)
    def compute_rewards(self, batch: DataProto) -> DataProto:
        """`scores` (the reward model's), `reward_failed` (all 0: a forward pass has no per-sample failure) and
        the decoded `response_text`, as `RewardWorker.compute_rewards` returns them."""
        scores = self._scores(batch)
        texts = response_texts(self.tokenizer, batch)
        return DataProto.from_dict(
            tensors={"scores": scores, "reward_failed": torch.zeros_like(scores)},
            non_tensors={"response_text": texts},
        )

    def _scores(self, batch: DataProto) -> torch.Tensor:
        def forward(micro_batch: DataProto, output: Any) -> tuple[None, dict[str, torch.Tensor]]:
            return None, {"scores": sequence_scores(output)}

        return self.strategy.forward_step(batch, forward)["scores"]


class ProcessRewardScoringWorker(StrategyWorker):
    """Scores `[prompt | response]` rows with a process reward model (`roll-rm --config-name rm_prm_arithmetic`):
    the response is split into steps at `step_separator` as the model's training data was, and the model's
    probability that a step is correct is sigmoid of its score at the step's last token.

    RLVR's `compute_rewards` gives `scores`, the `step_aggregate` of the probabilities (min or last: the sequence
    score of grpo and rloo), and with `step_rewards` on, `turn_rewards` for the estimators that credit tokens one
    by one (reinforce_plus_plus, gae), the multi-turn path's layout: on each step's last token, the change the
    step makes to the running aggregate (they sum to `scores`).
    """

    model_kind: ModelKind = "value"

    @register(Dispatch.DP_COMPUTE)
    def compute_rewards(self, batch: DataProto) -> DataProto:
        """`scores`, `reward_failed` (all 0), `response_text`, and `turn_rewards` / `turn_discounts` (all 1) when
        the cluster gives step rewards."""
        config = self.worker_config
        data = batch.batch

        def forward(micro_batch: DataProto, output: Any) -> tuple[None, dict[str, torch.Tensor]]:
            return None, {"step_scores": response_scores(output, micro_batch.batch["responses"].shape[1])}

        scores = self.strategy.forward_step(batch, forward)["step_scores"]
        separator = separator_ids(self.tokenizer, config.step_separator, f"{config.name}.step_separator")
        lengths = data["response_mask"].sum(-1)
        mask = step_end_mask(data["responses"], lengths, separator)
        rewards = step_rewards(scores, mask, config.step_aggregate)
        totals = rewards.sum(-1)  # the step_aggregate: the step rewards are its increments
        tensors = {"scores": totals, "reward_failed": torch.zeros_like(totals)}
        if config.step_rewards:
            tensors |= {"turn_rewards": rewards, "turn_discounts": torch.ones_like(rewards)}
        return DataProto.from_dict(
            tensors=tensors, non_tensors={"response_text": response_texts(self.tokenizer, batch)}
        )
