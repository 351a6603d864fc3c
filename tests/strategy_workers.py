"""The worker the strategy tests drive; Ray workers import it by module path.

It is roll's StrategyWorker (initialisation, offload, checkpoints, export) plus raw strategy calls:
a language-model loss over whole sequences, per-token log-probs and generation as the strategy returns it
(ids, lengths and stop reasons).
"""

from __future__ import annotations

import torch

from roll.configs.worker_config import GeneratingArguments
from roll.distributed.executor.strategy_worker import StrategyWorker as PipelineStrategyWorker
from roll.distributed.scheduler.decorator import Dispatch, register
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.strategy import Generation
from roll.models.hf_weights import hf_named_weights
from roll.utils.functionals import masked_mean, response_log_probs


def next_token_log_probs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of token t+1 given tokens up to t: `[B, T]` ids -> `[B, T-1]`."""
    return response_log_probs(logits, input_ids, input_ids.shape[1] - 1)


def lm_loss(batch: DataProto, output) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean next-token cross-entropy over attended positions."""
    log_probs = next_token_log_probs(output.logits, batch.batch["input_ids"])
    loss = -masked_mean(log_probs, batch.batch["attention_mask"][:, 1:])
    return loss, {}


def token_log_probs(batch: DataProto, output) -> tuple[None, dict[str, torch.Tensor]]:
    """Per-token log-probs of the batch's own tokens."""
    return None, {"log_probs": next_token_log_probs(output.logits, batch.batch["input_ids"])}


class StrategyWorker(PipelineStrategyWorker):
    """roll's StrategyWorker with the raw strategy calls the tests compare."""

    @register(Dispatch.DP_COMPUTE)
    def train(self, batch: DataProto) -> dict[str, float]:
        return self.strategy.train_step(batch, lm_loss)

    @register(Dispatch.DP_COMPUTE)
    def log_probs(self, batch: DataProto) -> DataProto:
        return DataProto.from_dict(tensors=self.strategy.forward_step(batch, token_log_probs))

    @register(Dispatch.DP_COMPUTE)
    def generate(self, batch: DataProto, args: GeneratingArguments) -> DataProto:
        return generation_batch(self.strategy.generate(batch, args))

    @register(Dispatch.ONE_TO_ALL)
    def hf_weights(self) -> dict[str, torch.Tensor]:
        """What this rank's weight sync sends (`iter_hf_weights`, which every rank runs), or the weights an inference
        engine holds: name -> tensor, on CPU."""
        if hasattr(self.strategy, "iter_hf_weights"):  # deepspeed_train and deepspeed_infer gather what they shard
            weights = self.strategy.iter_hf_weights()
        else:  # hf_infer holds a plain model
            weights = hf_named_weights(self.strategy.model)
        return {name: tensor.detach().cpu() for name, tensor in weights}

    @register(Dispatch.ONE_TO_ALL)
    def deepspeed_groups(self) -> dict[str, list[int]]:
        """Global ranks of this rank's DeepSpeed data-parallel group and its tensor-parallel group ([rank] without
        AutoTP): the groups the engine really averages gradients and all-gathers shards over."""
        from deepspeed.utils import groups

        engine = self.strategy.engine
        tp = groups.get_tensor_model_parallel_group() if self.strategy.tp_size > 1 else None
        return {
            "dp": torch.distributed.get_process_group_ranks(engine.data_parallel_group),
            "tp": torch.distributed.get_process_group_ranks(tp) if tp is not None else [self.rank],
        }


def generation_batch(generation: Generation) -> DataProto:
    """A strategy's `Generation` as a DataProto: `output_ids`, `response_lengths`, `truncated` (and `log_probs`)."""
    tensors = {
        "output_ids": generation.output_ids,
        "response_lengths": generation.response_lengths,
        "truncated": generation.truncated,
    }
    if generation.log_probs is not None:
        tensors["log_probs"] = generation.log_probs
    return DataProto.from_dict(tensors=tensors)
