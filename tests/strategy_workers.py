"""A worker that drives one strategy for the strategy tests; Ray workers import it by module path."""

from __future__ import annotations

import torch

from roll.configs.worker_config import GeneratingArguments
from roll.distributed.executor.worker import Worker
from roll.distributed.scheduler.decorator import Dispatch, register
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.factory import create_strategy
from roll.models.model_providers import load_model
from roll.utils.functionals import masked_mean, next_token_log_probs


def lm_loss(batch: DataProto, output) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean next-token cross-entropy over attended positions."""
    log_probs = next_token_log_probs(output.logits, batch.batch["input_ids"])
    loss = -masked_mean(log_probs, batch.batch["attention_mask"][:, 1:])
    return loss, {}


def token_log_probs(batch: DataProto, output) -> tuple[None, dict[str, torch.Tensor]]:
    """Per-token log-probs of the batch's own tokens."""
    return None, {"log_probs": next_token_log_probs(output.logits, batch.batch["input_ids"])}


class StrategyWorker(Worker):
    """Builds the role's model with its configured strategy and exposes the strategy's calls."""

    @register(Dispatch.ONE_TO_ALL)
    def initialize(self) -> None:
        name = self.worker_config.strategy_args.strategy_name
        self.strategy = create_strategy(name, self)
        trainable = name == "deepspeed_train"
        self.strategy.initialize(lambda: load_model(self.worker_config.model_args, trainable=trainable))

    @register(Dispatch.DP_COMPUTE)
    def train(self, batch: DataProto) -> dict[str, float]:
        return self.strategy.train_step(batch, lm_loss)

    @register(Dispatch.DP_COMPUTE)
    def log_probs(self, batch: DataProto) -> DataProto:
        return DataProto.from_dict(tensors=self.strategy.forward_step(batch, token_log_probs))

    @register(Dispatch.DP_COMPUTE)
    def generate(self, batch: DataProto, args: GeneratingArguments) -> DataProto:
        return DataProto.from_dict(tensors={"output_ids": self.strategy.generate(batch, args)})

    @register(Dispatch.ONE_TO_ALL)
    def save(self, save_dir: str, tag: str) -> str:
        return self.strategy.save_checkpoint(save_dir, tag)

    @register(Dispatch.ONE_TO_ALL)
    def load(self, load_dir: str, tag: str | None = None) -> str:
        return self.strategy.load_checkpoint(load_dir, tag)

    @register(Dispatch.ONE_TO_ALL)
    def export(self, output_dir: str) -> str:
        return self.strategy.export_hf(output_dir)

    @register(Dispatch.ONE_TO_ALL)
    def shutdown_strategy(self) -> None:
        self.strategy.shutdown()
