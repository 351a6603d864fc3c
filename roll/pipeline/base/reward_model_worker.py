"""A reward cluster that scores responses with a trained reward model (a scalar head on a backbone).

Selected in RLVR by `rewards.<key>.worker_cls`, with the exported reward model (`roll-rm`) as the
cluster's `model_args.model_name_or_path` and an inference strategy (hf_infer). It reads the same
token ids the policy generated, so the reward model must share the policy's tokenizer.
"""

from __future__ import annotations

from typing import Any

import torch

from roll.datasets.prompt_dataset import response_texts
from roll.distributed.executor.strategy_worker import StrategyWorker
from roll.distributed.scheduler.decorator import Dispatch, register
from roll.distributed.scheduler.protocol import DataProto
from roll.models.model_providers import ModelKind


def sequence_scores(output: Any) -> torch.Tensor:
    """The scalar score per row of a sequence-classification output with one label: `[B]`.

    transformers reads it at each row's last non-pad token (responses are right-padded).
    """
    return output.logits[:, 0].float()


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
