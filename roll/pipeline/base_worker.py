"""Workers that hold a strategy: the actor (train, infer, reference) and the critic.

They turn pipeline requests into strategy calls: generation into a response batch with masks,
forward passes into log-probs or values, DataProto shards into optimizer steps with the PPO loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
import torch

from roll.configs.worker_config import GeneratingArguments
from roll.distributed.executor.worker import Worker
from roll.distributed.scheduler.decorator import Dispatch, register
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.factory import create_strategy
from roll.models.model_providers import ModelKind, load_model, load_tokenizer
from roll.utils import ppo_losses
from roll.utils.functionals import masked_mean, response_log_probs, response_mask_from_ids


@dataclass
class PPOLossConfig:
    """The loss settings the driver sends with every actor or critic update."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    loss_agg_mode: str = "token-mean"
    entropy_coef: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_kind: str = "k3"
    value_clip: float | None = 0.5


def split_generation(output: torch.Tensor, prompt_length: int, eos_token_id: int, pad_token_id: int) -> dict:
    """Tensors of a rollout from `[prompt | generated]` ids: responses, masks and the full sequence."""
    prompts, responses = output[:, :prompt_length], output[:, prompt_length:]
    response_mask = response_mask_from_ids(responses, eos_token_id, pad_token_id)
    responses = responses.masked_fill(response_mask == 0, pad_token_id)
    prompt_mask = (prompts != pad_token_id).long()
    return {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
    }


class StrategyWorker(Worker):
    """A worker owning one strategy over one model of `model_kind`."""

    model_kind: ModelKind = "causal_lm"

    @register(Dispatch.ONE_TO_ALL)
    def initialize(self) -> None:
        """Create the strategy named in the config and build the model inside it."""
        config = self.worker_config
        name = config.strategy_args.strategy_name
        self.tokenizer = load_tokenizer(config.model_args.model_name_or_path)
        self.strategy = create_strategy(name, self)
        trainable = name == "deepspeed_train"
        self.strategy.initialize(lambda: load_model(config.model_args, self.model_kind, trainable=trainable))

    @register(Dispatch.ONE_TO_ALL)
    def offload_states(self) -> dict[str, float]:
        """Move this worker's model states off the device."""
        return self.strategy.offload_states()

    @register(Dispatch.ONE_TO_ALL)
    def load_states(self) -> dict[str, float]:
        """Bring this worker's model states back to the device."""
        return self.strategy.load_states()

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, save_dir: str, tag: str) -> str:
        """A resumable checkpoint of a training strategy."""
        return self.strategy.save_checkpoint(save_dir, tag)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, load_dir: str, tag: str | None = None) -> str:
        """Resume a training strategy."""
        return self.strategy.load_checkpoint(load_dir, tag)

    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, output_dir: str) -> str:
        """Write a Hugging Face model directory (and the tokenizer)."""
        path = self.strategy.export_hf(output_dir)
        if self.rank == 0:
            self.tokenizer.save_pretrained(path)
        return path

    @register(Dispatch.ONE_TO_ALL)
    def weight_buckets(self, bucket_bytes: int) -> list[ray.ObjectRef] | None:
        """Full weights in buckets of about `bucket_bytes`, put in Ray's object store by rank 0.

        Every rank must take part (ZeRO-3 gathers each parameter collectively); only rank 0
        returns the references.
        """
        buckets: list[ray.ObjectRef] = []
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in self.strategy.iter_hf_weights():
            if self.rank != 0:
                continue
            bucket.append((name, tensor.cpu()))
            size += tensor.numel() * tensor.element_size()
            if size >= bucket_bytes:
                buckets.append(ray.put(bucket))
                bucket, size = [], 0
        if bucket:
            buckets.append(ray.put(bucket))
        return buckets if self.rank == 0 else None

    @register(Dispatch.ONE_TO_ALL)
    def load_weight_buckets(self, buckets: list[ray.ObjectRef]) -> int:
        """Load new weights bucket by bucket (one bucket in memory at a time); return the bytes loaded."""
        loaded = 0
        for ref in buckets:
            named_tensors = ray.get(ref)
            self.strategy.load_weights(named_tensors)
            loaded += sum(t.numel() * t.element_size() for _, t in named_tensors)
        return loaded


class ActorWorker(StrategyWorker):
    """The policy: generates (actor_infer), scores log-probs (reference, old log-probs) and trains (actor_train)."""

    @register(Dispatch.DP_COMPUTE)
    def generate(self, batch: DataProto, generating_args: GeneratingArguments) -> DataProto:
        """Responses to the prompts in `batch` (`num_return_sequences` per prompt, next to each other)."""
        output = self.strategy.generate(batch, generating_args)
        prompt_length = batch.batch["input_ids"].shape[1]
        tensors = split_generation(output, prompt_length, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id)
        repeated = batch.select(batch_keys=[]).repeat(generating_args.num_return_sequences, interleave=True)
        return DataProto.from_dict(tensors=tensors, non_tensors=repeated.non_tensor_batch, meta_info=batch.meta_info)

    @register(Dispatch.DP_COMPUTE)
    def compute_log_probs(self, batch: DataProto) -> DataProto:
        """Per-token log-probs of the responses under this worker's model: `log_probs` `[B, R]`."""
        response_length = batch.batch["responses"].shape[1]

        def forward(micro_batch: DataProto, output: Any) -> tuple[None, dict[str, torch.Tensor]]:
            return None, {
                "log_probs": response_log_probs(output.logits, micro_batch.batch["input_ids"], response_length)
            }

        return DataProto.from_dict(tensors=self.strategy.forward_step(batch, forward))

    @register(Dispatch.DP_COMPUTE)
    def sft_step(self, batch: DataProto) -> dict[str, float]:
        """Supervised update: mean negative log-likelihood of the response tokens."""
        response_length = batch.batch["responses"].shape[1]

        def loss_func(micro_batch: DataProto, output: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            log_probs = response_log_probs(output.logits, micro_batch.batch["input_ids"], response_length)
            return -masked_mean(log_probs, micro_batch.batch["response_mask"]), {}

        return self.strategy.train_step(batch, loss_func)

    @register(Dispatch.DP_COMPUTE)
    def train_step(self, batch: DataProto, loss_config: PPOLossConfig) -> dict[str, float]:
        """PPO update on this rank's shard: clipped surrogate, optional entropy bonus and KL loss."""
        response_length = batch.batch["responses"].shape[1]

        def loss_func(micro_batch: DataProto, output: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            data = micro_batch.batch
            logits = output.logits[:, -response_length - 1 : -1]
            log_probs = response_log_probs(output.logits, data["input_ids"], response_length)
            mask = data["response_mask"]
            loss, metrics = ppo_losses.policy_loss(
                log_probs,
                data["old_log_probs"],
                data["advantages"],
                mask,
                clip_low=loss_config.clip_low,
                clip_high=loss_config.clip_high,
                dual_clip=loss_config.dual_clip,
                agg_mode=loss_config.loss_agg_mode,
            )
            if loss_config.entropy_coef:
                entropy = ppo_losses.aggregate_loss(
                    ppo_losses.entropy_from_logits(logits), mask, loss_config.loss_agg_mode
                )
                loss = loss - loss_config.entropy_coef * entropy
                metrics["entropy"] = entropy.detach()
            if loss_config.use_kl_loss:
                kl = ppo_losses.kl_loss(
                    log_probs, data["ref_log_probs"], mask, loss_config.kl_kind, loss_config.loss_agg_mode
                )
                loss = loss + loss_config.kl_loss_coef * kl
                metrics["kl_loss"] = kl.detach()
            return loss, metrics

        return self.strategy.train_step(batch, loss_func)


class CriticWorker(StrategyWorker):
    """The value model of GAE: per-token values and the clipped value loss."""

    model_kind: ModelKind = "value"

    @register(Dispatch.DP_COMPUTE)
    def compute_values(self, batch: DataProto) -> DataProto:
        """Value of each response position: `values` `[B, R]`."""
        response_length = batch.batch["responses"].shape[1]

        def forward(micro_batch: DataProto, output: Any) -> tuple[None, dict[str, torch.Tensor]]:
            return None, {"values": self._response_values(output, response_length)}

        return DataProto.from_dict(tensors=self.strategy.forward_step(batch, forward))

    @staticmethod
    def _response_values(output: Any, response_length: int) -> torch.Tensor:
        # The value of the state before token t is read at position t - 1, like the log-probs.
        return output.logits[:, -response_length - 1 : -1, 0].float()

    @register(Dispatch.DP_COMPUTE)
    def train_step(self, batch: DataProto, loss_config: PPOLossConfig) -> dict[str, float]:
        """Clipped value regression towards the returns."""
        response_length = batch.batch["responses"].shape[1]

        def loss_func(micro_batch: DataProto, output: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            data = micro_batch.batch
            return ppo_losses.value_loss(
                self._response_values(output, response_length),
                data["values"],
                data["returns"],
                data["response_mask"],
                clip=loss_config.value_clip,
                agg_mode=loss_config.loss_agg_mode,
            )

        return self.strategy.train_step(batch, loss_func)
