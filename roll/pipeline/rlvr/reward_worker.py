"""Reward workers: score responses with a Python function, isolated so a bad function cannot stop a run."""

from __future__ import annotations

import multiprocessing

import torch

from roll.datasets.responses import response_texts
from roll.distributed.executor.worker import Worker
from roll.distributed.scheduler.decorator import Dispatch, register
from roll.distributed.scheduler.protocol import DataProto
from roll.models.model_providers import load_tokenizer
from roll.rewards import reward_process


class RewardWorker(Worker):
    """Decodes responses and scores them in a child process, each sample with a deadline.

    A sample whose function raises, runs past `timeout_s` or kills its process scores 0 and is counted
    as failed; a hung or dead child is replaced, and scoring goes on with the next sample.
    """

    @register(Dispatch.ONE_TO_ALL)
    def initialize(self) -> None:
        """Load the tokenizer and start the scoring process."""
        config = self.worker_config
        for dotted in config.reward_fns:  # fail at start-up, not once per sample
            reward_process.import_reward_fn(dotted)
        self.tokenizer = load_tokenizer(config.model_args.model_name_or_path)
        # Children fork from a server that has the reward function's module imported already, so
        # replacing a hung child costs milliseconds.
        context = multiprocessing.get_context("forkserver")
        modules = [dotted.rpartition(".")[0] for dotted in config.reward_fns]
        context.set_forkserver_preload([reward_process.__name__, *modules])
        self._scorer = reward_process.Scorer(context, config.reward_fns, config.reward_weights)

    @register(Dispatch.DP_COMPUTE)
    def compute_rewards(self, batch: DataProto) -> DataProto:
        """`scores` and `reward_failed` per row, from `responses` / `response_mask` and the `answer` column."""
        texts = response_texts(self.tokenizer, batch)
        samples = list(zip(batch.non_tensor_batch["prompt"], texts, batch.non_tensor_batch["answer"], strict=True))
        scores, failed = self._score_all(samples)
        return DataProto.from_dict(
            tensors={"scores": torch.tensor(scores), "reward_failed": torch.tensor(failed)},
            non_tensors={"response_text": texts},
        )

    def _score_all(self, samples: list[reward_process.Sample]) -> tuple[list[float], list[float]]:
        scores: list[float] = []
        failed: list[float] = []
        outcomes = self._scorer.score_all(samples, self.worker_config.timeout_s)
        for sample, outcome in zip(samples, outcomes, strict=True):
            if isinstance(outcome, Exception):
                scores.append(0.0)
                failed.append(1.0)
                self.logger.warning("reward_fn failed on response %r: %s", sample[1][:80], outcome)
            else:
                scores.append(outcome)
                failed.append(0.0)
        return scores, failed

    def close(self) -> None:
        """Stop the scoring process."""
        scorer = getattr(self, "_scorer", None)
        if scorer is not None:
            scorer.close()
