"""The RL roles: the actor (train, infer, reference) and the critic, with their losses.

They turn pipeline requests into strategy calls: generation into a response batch with masks,
forward passes into log-probs or values, DataProto shards into optimizer steps with the PPO loss.
What every strategy-holding worker does (offload, checkpoints, weight sync) is
`roll.distributed.executor.strategy_worker.StrategyWorker`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from roll.algorithms import policy_losses
from roll.algorithms.kl import masked_kl_estimate
from roll.configs.algorithm_config import AlgorithmArguments
from roll.configs.worker_config import GeneratingArguments
from roll.distributed.executor.strategy_worker import StrategyWorker
from roll.distributed.scheduler.decorator import Dispatch, register
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.micro_batches import step_normalised
from roll.distributed.strategy.response_scores import scored_logits
from roll.distributed.strategy.strategy import Generation
from roll.models.model_providers import ModelKind
from roll.utils.functionals import length_mask, masked_mean, response_log_probs

# meta_info key: the maximum response length (max_new_tokens), the constant of loss_agg_mode seq-mean-token-sum-norm;
# a micro-batch's own width is no constant once token budgets trim its padding.
MAX_RESPONSE_LENGTH = "max_response_length"
# meta_info key on a generate request: also return the engine's log-prob of each sampled token (`engine_log_probs`).
WITH_ENGINE_LOG_PROBS = "with_engine_log_probs"


def split_generation(generation: Generation, prompt_mask: torch.Tensor) -> dict:
    """Tensors of a rollout from a strategy's `Generation`: responses, masks, the full sequence and `truncated`.

    The response mask is 1 on the tokens the engine sampled (its reported lengths, the final EOS or stop
    token included), never re-derived from token ids: EOS may be several ids or equal the pad id, and a stop
    string ends on an ordinary token. `prompt_mask` is the prompts' own attention mask (one row per sample),
    carried for the same reason: when pad = eos, a chat template's eos inside a prompt must stay attended.
    After each length the ids are the pad id the engine generated with.
    """
    prompt_length = prompt_mask.shape[1]
    output = generation.output_ids
    prompts, responses = output[:, :prompt_length], output[:, prompt_length:]
    response_mask = length_mask(generation.response_lengths, responses.shape[1])
    return {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask.to(response_mask.dtype), response_mask], dim=1),
        "truncated": generation.truncated,
    }


class ActorWorker(StrategyWorker):
    """The policy: generates (actor_infer), scores log-probs (reference, old log-probs) and trains (actor_train)."""

    @register(Dispatch.DP_COMPUTE)
    def generate(self, batch: DataProto, generating_args: GeneratingArguments) -> DataProto:
        """Responses to the prompts in `batch` (`num_return_sequences` per prompt, next to each other).

        The rollout holds `truncated` `[B]` (cut at max_new_tokens). With `meta_info[WITH_ENGINE_LOG_PROBS]` it
        also holds `engine_log_probs` `[B, R]`, the engine's own log-prob of each sampled token (strategies with
        `generate_with_log_probs`: hf_infer, vllm, sglang).

        A seed is the batch's: this data-parallel rank's rows are seeded from where the previous ranks' rows end
        (vLLM seeds prompt i with seed + i * n), so identical prompts on two ranks do not sample identical tokens.
        """
        if generating_args.seed is not None:
            offset = self.rank_info.dp_rank * len(batch) * generating_args.num_return_sequences
            generating_args = replace(generating_args, seed=generating_args.seed + offset)
        if not batch.meta_info.get(WITH_ENGINE_LOG_PROBS):
            return self.to_rollout(batch, self.strategy.generate(batch, generating_args), generating_args)
        generation = self.strategy.generate_with_log_probs(batch, generating_args)
        rollout = self.to_rollout(batch, generation, generating_args)
        return rollout.union(DataProto.from_dict(tensors={"engine_log_probs": generation.log_probs}))

    def to_rollout(self, batch: DataProto, generation: Generation, generating_args: GeneratingArguments) -> DataProto:
        """The rollout batch of a `Generation` for the prompts in `batch` (samples of a prompt adjacent)."""
        n = generating_args.num_return_sequences
        repeated = batch.select(batch_keys=["attention_mask"]).repeat(n, interleave=True)
        prompt_mask = repeated.batch.pop("attention_mask")
        tensors = split_generation(generation, prompt_mask)
        return DataProto.from_dict(tensors=tensors, non_tensors=repeated.non_tensor_batch, meta_info=batch.meta_info)

    @register(Dispatch.DP_COMPUTE)
    def compute_log_probs(self, batch: DataProto) -> DataProto:
        """Per-token log-probs of the responses under this worker's model: `log_probs` `[B, R]` (forward passes, or
        an engine's prompt log-probs: see `InferenceStrategy.response_log_probs`)."""
        return DataProto.from_dict(tensors={"log_probs": self.strategy.response_log_probs(batch)})

    @register(Dispatch.DP_COMPUTE)
    def sft_step(self, batch: DataProto) -> dict[str, float]:
        """Supervised update: mean negative log-likelihood of the response tokens of each optimizer step (on every
        data-parallel rank)."""

        def loss_func(micro_batch: DataProto, output: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            response_length = micro_batch.batch["responses"].shape[1]
            log_probs = response_log_probs(output.logits, micro_batch.batch["input_ids"], response_length)
            loss = -masked_mean(log_probs, micro_batch.batch["response_mask"])
            return step_normalised(loss, micro_batch, "token-mean"), {}

        return self.strategy.train_step(batch, loss_func)

    @register(Dispatch.DP_COMPUTE)
    def train_step(self, batch: DataProto, algorithm: AlgorithmArguments) -> dict[str, float]:
        """PPO update on this rank's shard: clipped surrogate, optional entropy bonus and KL loss.

        A batch without `old_log_probs` must be one optimizer step on this rank: the weights of every
        micro-batch's forward pass are then the ones that would have scored them, so the old log-probs
        are that pass's own, detached (ratio 1). Its `kl` metric then reports, before the update, what
        the driver's `actor/kl` reports from a separate pass.
        """
        from_update = "old_log_probs" not in batch.batch
        if from_update:
            args = self.worker_config.training_args
            step_rows = args.per_device_train_batch_size * args.gradient_accumulation_steps
            if len(batch) != step_rows:
                raise ValueError(
                    f"a shard of {len(batch)} rows without old_log_probs: the update's own log-probs stand in for "
                    f"them only within one optimizer step ({step_rows} rows per rank); compute old_log_probs first"
                )

        def loss_func(micro_batch: DataProto, output: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            data = micro_batch.batch
            response_length = data["responses"].shape[1]
            all_logits = scored_logits(output.logits, micro_batch)
            logits = all_logits[:, -response_length - 1 : -1]
            log_probs = response_log_probs(all_logits, data["input_ids"], response_length)
            mask = data["response_mask"]
            old_log_probs = log_probs.detach() if from_update else data["old_log_probs"]
            norm_length = micro_batch.meta_info.get(MAX_RESPONSE_LENGTH)
            weights = None
            if algorithm.tis_cap is not None:
                weights = policy_losses.tis_weights(old_log_probs, data["engine_log_probs"], mask, algorithm.tis_cap)
            loss, metrics = policy_losses.policy_loss(
                log_probs,
                old_log_probs,
                data["advantages"],
                mask,
                clip_low=algorithm.clip_low,
                clip_high=algorithm.clip_high,
                dual_clip=algorithm.dual_clip,
                agg_mode=algorithm.loss_agg_mode,
                norm_length=norm_length,
                importance_level=algorithm.importance_level,
                token_weights=weights,
            )
            if weights is not None:
                metrics.update(
                    policy_losses.tis_metrics(old_log_probs, data["engine_log_probs"], mask, algorithm.tis_cap)
                )
            if algorithm.entropy_coef:
                entropy = policy_losses.aggregate_loss(
                    policy_losses.entropy_from_logits(logits), mask, algorithm.loss_agg_mode, norm_length
                )
                loss = loss - algorithm.entropy_coef * entropy
                metrics["entropy"] = entropy.detach()
            if algorithm.use_kl_loss:
                kl = policy_losses.kl_loss(
                    log_probs, data["ref_log_probs"], mask, algorithm.kl_loss_kind, algorithm.loss_agg_mode, norm_length
                )
                loss = loss + algorithm.kl_loss_coef * kl
                metrics["kl_loss"] = kl.detach()
            if from_update and "ref_log_probs" in data:
                ref_log_probs, kind = data["ref_log_probs"], algorithm.kl_penalty_kind
                token_kl = masked_kl_estimate(log_probs.detach(), ref_log_probs, mask, kind)
                metrics["kl"] = masked_mean(token_kl, mask, dim=-1).mean()
            return step_normalised(loss, micro_batch, algorithm.loss_agg_mode), metrics

        return self.strategy.train_step(batch, loss_func)


class CriticWorker(StrategyWorker):
    """The value model of GAE: per-token values and the clipped value loss."""

    model_kind: ModelKind = "value"

    @register(Dispatch.DP_COMPUTE)
    def compute_values(self, batch: DataProto) -> DataProto:
        """Value of each response position: `values` `[B, R]`."""

        def forward(micro_batch: DataProto, output: Any) -> tuple[None, dict[str, torch.Tensor]]:
            return None, {"values": self._response_values(output, micro_batch.batch["responses"].shape[1])}

        return DataProto.from_dict(tensors=self.strategy.forward_step(batch, forward))

    @staticmethod
    def _response_values(output: Any, response_length: int) -> torch.Tensor:
        # The value of the state before token t is read at position t - 1, like the log-probs.
        return output.logits[:, -response_length - 1 : -1, 0].float()

    @register(Dispatch.DP_COMPUTE)
    def train_step(self, batch: DataProto, algorithm: AlgorithmArguments) -> dict[str, float]:
        """Clipped value regression towards the returns."""

        def loss_func(micro_batch: DataProto, output: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            data = micro_batch.batch
            loss, metrics = policy_losses.value_loss(
                self._response_values(output, data["responses"].shape[1]),
                data["values"],
                data["returns"],
                data["response_mask"],
                clip=algorithm.value_clip,
                agg_mode=algorithm.loss_agg_mode,
                norm_length=micro_batch.meta_info.get(MAX_RESPONSE_LENGTH),
            )
            return step_normalised(loss, micro_batch, algorithm.loss_agg_mode), metrics

        return self.strategy.train_step(batch, loss_func)
