"""The DPO driver loop: the frozen reference scores a batch of pairs once, then the policy takes a preference step.

The policy (`actor_train`) and the reference take turns on shared devices (`Residency` offloads the
one a phase does not need), or run on devices of their own. Held-out preference accuracy, the
fraction of held-out pairs whose implicit reward ranks the chosen response first, is printed
before -> after; the trained policy is exported as a Hugging Face directory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from roll.datasets.preference_dataset import encode_pairs, load_preference_splits
from roll.datasets.prompt_dataset import PromptSampler, pad_token_id
from roll.distributed.scheduler.protocol import DataProto
from roll.models.model_providers import load_tokenizer
from roll.models.tiny import resolve_model_path
from roll.pipeline import checkpoint_state
from roll.pipeline.base_pipeline import BasePipeline
from roll.pipeline.dpo.dpo_config import DPOConfig
from roll.pipeline.rlvr import phases
from roll.pipeline.run_tracking import open_run_tracker
from roll.utils.dpo_losses import LENGTH_AVERAGED, ranking_accuracy, sequence_log_probs
from roll.utils.tracking import show_progress

# The policy scoring held-out pairs: only actor_train's states need to be resident.
EVAL_LOG_PROBS = phases.Phase("eval_log_probs", frozenset({"actor_train"}))
TRAINED_ROLE = "actor_train"


class DPOPipeline(BasePipeline):
    """Direct preference optimisation of `actor_train` on chosen/rejected pairs against a frozen `reference`."""

    config: DPOConfig

    def __init__(self, config: DPOConfig) -> None:
        super().__init__(config)
        for role in config.roles().values():
            resolve_model_path(role.model_args.model_name_or_path)  # build tiny models once, here
        tokenizer = load_tokenizer(config.actor_train.model_args.model_name_or_path)
        self.pad_id = pad_token_id(tokenizer)
        train_pairs, eval_pairs = load_preference_splits(config.data, tokenizer, config.max_response_length)
        self.sampler = PromptSampler(train_pairs, config.batch_size, config.seed)
        self.eval_batch = encode_pairs(eval_pairs[: config.eval_batch_size or None], self.pad_id)
        self.average = config.loss.loss_type in LENGTH_AVERAGED
        self.run_dir = Path(config.run_dir)
        for name in (TRAINED_ROLE, "reference"):
            self.start_cluster(name)
        for future in [cluster.initialize(blocking=False) for cluster in self.clusters.values()]:
            future.get()
        self.residency = phases.Residency(self.clusters, {name: role.devices for name, role in config.roles().items()})
        self.eval_reference: torch.Tensor | None = None

    def sequence_log_probs(self, role: str, batch: DataProto, phase: phases.Phase) -> torch.Tensor:
        """Each row's sequence log-prob under `role`'s model (summed, or averaged for length-averaged losses)."""
        self.residency.enter(phase)
        cluster = self.clusters[role]
        padded, pad = batch.pad_to_divisor(cluster.world_size)
        token_log_probs = cluster.compute_log_probs(padded).unpad(pad).batch["log_probs"]
        return sequence_log_probs(token_log_probs, batch.batch["response_mask"], self.average)

    def evaluate(self) -> dict[str, float]:
        """Held-out preference accuracy and reward margin of the policy's implicit reward, and how often the
        policy itself gives the chosen response the higher log-prob."""
        if self.eval_reference is None:  # the reference is frozen: its held-out scores are computed once
            self.eval_reference = self.sequence_log_probs("reference", self.eval_batch, phases.REFERENCE_LOG_PROBS)
        policy = self.sequence_log_probs(TRAINED_ROLE, self.eval_batch, EVAL_LOG_PROBS)
        rewards = self.config.loss.beta * (policy - self.eval_reference)
        return {
            "val/preference_accuracy": ranking_accuracy(rewards[0::2], rewards[1::2]).item(),
            "val/reward_margin": (rewards[0::2] - rewards[1::2]).mean().item(),
            "val/policy_ranking_accuracy": ranking_accuracy(policy[0::2], policy[1::2]).item(),
        }

    def step(self) -> dict[str, float]:
        """One preference step: the reference scores the batch, then the policy updates on it."""
        timings: dict[str, float] = {}
        batch = encode_pairs(self.sampler.next_batch(), self.pad_id)
        with self.residency.timed(phases.REFERENCE_LOG_PROBS, timings):
            reference = self.clusters["reference"].compute_log_probs(batch).rename("log_probs", "ref_log_probs")
        with self.residency.timed(phases.ACTOR_UPDATE, timings):
            metrics = self.clusters[TRAINED_ROLE].preference_step(batch.union(reference), self.config.loss)[0]
        # Train metrics are already averaged over ranks by the strategy: rank 0 speaks for all.
        return {f"actor/{key}": value for key, value in metrics.items()} | timings

    def save(self, step: int, history: list[dict[str, float]]) -> str:
        """Checkpoint the policy and the driver's state at `step`; return the checkpoint path."""
        root, tag = self.config.checkpoint_root, f"step_{step}"
        self.residency.enter(phases.ACTOR_UPDATE)
        self.clusters[TRAINED_ROLE].save_checkpoint(str(root / TRAINED_ROLE), tag)
        state = {"step": step, "sampler": self.sampler.state_dict(), "val_history": history}
        return checkpoint_state.save_driver_state(root, tag, state)

    def resume(self) -> dict:
        """Restore the policy and the driver state from `resume_from_checkpoint`; return the driver state."""
        root = self.config.checkpoint_root
        state = checkpoint_state.load_driver_state(root, self.config.resume_tag)
        self.residency.enter(phases.ACTOR_UPDATE)
        self.clusters[TRAINED_ROLE].load_checkpoint(str(root / TRAINED_ROLE), f"step_{state['step']}")
        self.sampler.load_state_dict(state["sampler"])
        return state

    def run(self) -> dict[str, float]:
        """Train for `max_steps`, checkpoint, export; print and return held-out preference accuracy before and after."""
        config = self.config
        start_step, history = 0, []
        if config.resume_from_checkpoint:
            state = self.resume()
            start_step, history = state["step"], state["val_history"]
        tracker = open_run_tracker(config, start_step)
        if not start_step:
            history.append(self.evaluate())
            tracker.log(history[-1], 0)
        progress = show_progress(range(start_step + 1, config.max_steps + 1), desc="dpo")
        for step in progress:
            started = time.perf_counter()
            metrics = self.step()
            if step % config.eval_steps == 0 or step == config.max_steps:
                history.append(self.evaluate())
                metrics.update(history[-1])
            metrics["time/step_s"] = time.perf_counter() - started
            tracker.log(metrics, step)
            progress.set_postfix(
                loss=f"{metrics['actor/loss']:.3f}",
                margin=f"{metrics['actor/rewards/margin']:.2f}",
                val_acc=f"{history[-1]['val/preference_accuracy']:.2f}",
            )
            if config.save_steps and step % config.save_steps == 0 and step != config.max_steps:
                self.save(step, history)
        self.save(config.max_steps, history)
        export_dir = self.clusters[TRAINED_ROLE].export_hf(config.model_export_dir)[0]
        tracker.close()
        before, after = history[0], history[-1]
        summary = {
            "val_preference_accuracy_before": before["val/preference_accuracy"],
            "val_preference_accuracy_after": after["val/preference_accuracy"],
            "val_policy_ranking_accuracy_before": before["val/policy_ranking_accuracy"],
            "val_policy_ranking_accuracy_after": after["val/policy_ranking_accuracy"],
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"logs and TensorBoard events in {tracker.log_dir}; model exported to {export_dir}", flush=True)
        print(
            f"held-out preference accuracy {before['val/preference_accuracy']:.2f} -> "
            f"{after['val/preference_accuracy']:.2f} (policy ranks the chosen response first: "
            f"{before['val/policy_ranking_accuracy']:.2f} -> {after['val/policy_ranking_accuracy']:.2f})",
            flush=True,
        )
        return summary
