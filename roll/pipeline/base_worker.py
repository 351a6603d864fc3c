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
from roll.distributed.weight_sync.broadcast import (
    DEFAULT_TIMEOUT_S,
    BroadcastGroup,
    SyncHeaders,
    open_store,
    receive_weights,
    send_weights,
)
from roll.distributed.weight_sync.buckets import iter_buckets
from roll.distributed.weight_sync.colocated import SharedBucket, hand_over, open_bucket
from roll.distributed.weight_sync.plan import BROADCAST_SOURCE
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
        self.broadcast_sources: dict[str, tuple[BroadcastGroup, SyncHeaders, list[int]]] = {}

    def close(self) -> None:
        """Shut the strategy down (engines and their processes, process groups)."""
        strategy = getattr(self, "strategy", None)
        if strategy is not None:
            strategy.shutdown()

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

    # ---- weight sync: called by roll.distributed.weight_sync.syncer.WeightSyncer, rank by rank --------

    def weight_sync_shards(self) -> int:
        """Ranks this worker's engine takes in a weight-broadcast group (its tensor-parallel shards)."""
        return self.strategy.weight_sync_shards

    def open_weight_broadcast(
        self, target: str, address: str, port: int, world_size: int, ranks: tuple[int, ...], receivers: list[int]
    ) -> None:
        """Join the group that broadcasts weights to role `target`: as its source or as one of its workers.

        The source (`ranks == (0,)`, a training rank) sends to the `receivers` group ranks; a training
        rank may feed several roles, one group each.
        """
        backend = self.platform.dist_backend
        if ranks == (BROADCAST_SOURCE,):
            device = self.platform.device_name(self.local_rank)
            group = BroadcastGroup(address, port, BROADCAST_SOURCE, world_size, backend, device)
            self.broadcast_sources[target] = (group, SyncHeaders(group.store), receivers)
            return
        self.sync_headers = SyncHeaders(open_store(address, port, is_master=False, timeout_s=DEFAULT_TIMEOUT_S))
        self.sync_rank = ranks[0]
        self.strategy.join_weight_broadcast(address, port, ranks, world_size, backend)

    def send_weights(self, bucket_bytes: int, colocated: list[ray.actor.ActorHandle], broadcast_to: str | None) -> dict:
        """Stream the full weights in buckets to `colocated` inference workers and to the group of role `broadcast_to`.

        Returns the bytes handed over on the node and the bytes broadcast.
        """
        totals = {"colocated_bytes": 0, "broadcast_bytes": 0}
        if not (colocated or broadcast_to or self.strategy.weights_gathered_collectively):
            return totals
        buckets = hand_over(iter_buckets(self.strategy.iter_hf_weights(), bucket_bytes), colocated, totals)
        if broadcast_to:
            group, headers, receivers = self.broadcast_sources[broadcast_to]
            totals["broadcast_bytes"] = send_weights(headers, group, buckets, receivers)
        else:
            for _ in buckets:  # a rank without routes still takes part in ZeRO-3's gathers
                pass
        return totals

    def receive_colocated_bucket(self, shared: SharedBucket) -> int:
        """Load a bucket a training rank on this worker's device handed over; return its bytes."""
        self.strategy.load_weights(open_bucket(shared))
        return shared.nbytes

    def receive_weight_broadcast(self) -> int:
        """Receive one sync over the broadcast group (checked bucket by bucket); return the bytes loaded."""
        return receive_weights(
            self.sync_headers, self.sync_rank, self.strategy.check_weights, self.strategy.receive_weight_bucket
        )


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
