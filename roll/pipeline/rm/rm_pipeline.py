"""The reward-model driver loop: Bradley-Terry steps on preference pairs, held-out pairwise accuracy, HF export.

Held-out pairwise accuracy, the fraction of held-out pairs whose chosen response the model scores
higher, is printed before -> after. The export loads with AutoModelForSequenceClassification and
serves RLVR as a reward cluster (`roll.pipeline.rlvr.reward_model_worker.RewardModelWorker`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from roll.datasets.preference_dataset import encode_pairs, load_preference_splits
from roll.datasets.prompt_dataset import PromptSampler, pad_token_id
from roll.distributed.scheduler.protocol import DataProto
from roll.models.model_providers import load_tokenizer
from roll.models.tiny import resolve_model_path
from roll.pipeline import checkpoint_state
from roll.pipeline.base_pipeline import BasePipeline
from roll.pipeline.rm.rm_config import RMConfig
from roll.pipeline.run_tracking import open_run_tracker
from roll.utils.dpo_losses import ranking_accuracy
from roll.utils.tracking import show_progress

ROLE = "reward_model"


class RMPipeline(BasePipeline):
    """Trains `reward_model` to score each pair's chosen response above its rejected one."""

    config: RMConfig

    def __init__(self, config: RMConfig) -> None:
        super().__init__(config)
        model_path = config.reward_model.model_args.model_name_or_path
        resolve_model_path(model_path)  # build a tiny model once, here
        tokenizer = load_tokenizer(model_path)
        self.pad_id = pad_token_id(tokenizer)
        train_pairs, eval_pairs = load_preference_splits(config.data, tokenizer, config.max_response_length)
        self.sampler = PromptSampler(train_pairs, config.batch_size, config.seed)
        self.eval_batch = encode_pairs(eval_pairs[: config.eval_batch_size or None], self.pad_id)
        self.run_dir = Path(config.run_dir)
        self.cluster = self.start_cluster(ROLE)
        self.cluster.initialize()

    def scores(self, batch: DataProto) -> DataProto:
        """The reward model's score of every row of `batch`."""
        padded, pad = batch.pad_to_divisor(self.cluster.world_size)
        return self.cluster.compute_scores(padded).unpad(pad)

    def evaluate(self) -> dict[str, float]:
        """Held-out pairwise accuracy (a tie counts half) and the mean score gap of chosen over rejected."""
        scores = self.scores(self.eval_batch).batch["scores"]
        chosen, rejected = scores[0::2], scores[1::2]
        return {
            "val/preference_accuracy": ranking_accuracy(chosen, rejected).item(),
            "val/reward_margin": (chosen - rejected).mean().item(),
        }

    def step(self) -> dict[str, float]:
        """One Bradley-Terry step on the next batch of pairs."""
        batch = encode_pairs(self.sampler.next_batch(), self.pad_id)
        metrics = self.cluster.reward_pair_step(batch, self.config.margin)[0]
        # Train metrics are already averaged over ranks by the strategy: rank 0 speaks for all.
        return {f"reward_model/{key}": value for key, value in metrics.items()}

    def save(self, step: int, history: list[dict[str, float]]) -> str:
        """Checkpoint the model and the driver's state at `step`; return the checkpoint path."""
        root, tag = self.config.checkpoint_root, f"step_{step}"
        self.cluster.save_checkpoint(str(root / ROLE), tag)
        state = {"step": step, "sampler": self.sampler.state_dict(), "val_history": history}
        return checkpoint_state.save_driver_state(root, tag, state)

    def resume(self) -> dict:
        """Restore the model and the driver state from `resume_from_checkpoint`; return the driver state."""
        root = self.config.checkpoint_root
        state = checkpoint_state.load_driver_state(root, self.config.resume_tag)
        self.cluster.load_checkpoint(str(root / ROLE), f"step_{state['step']}")
        self.sampler.load_state_dict(state["sampler"])
        return state

    def run(self) -> dict[str, float]:
        """Train for `max_steps`, checkpoint, export; print and return held-out pairwise accuracy before and after."""
        config = self.config
        start_step, history = 0, []
        if config.resume_from_checkpoint:
            state = self.resume()
            start_step, history = state["step"], state["val_history"]
        tracker = open_run_tracker(config, start_step)
        if not start_step:
            history.append(self.evaluate())
            tracker.log(history[-1], 0)
        progress = show_progress(range(start_step + 1, config.max_steps + 1), desc="rm")
        for step in progress:
            started = time.perf_counter()
            metrics = self.step()
            if step % config.eval_steps == 0 or step == config.max_steps:
                history.append(self.evaluate())
                metrics.update(history[-1])
            metrics["time/step_s"] = time.perf_counter() - started
            tracker.log(metrics, step)
            progress.set_postfix(
                loss=f"{metrics['reward_model/loss']:.3f}",
                acc=f"{metrics['reward_model/accuracy']:.2f}",
                val_acc=f"{history[-1]['val/preference_accuracy']:.2f}",
            )
            if config.save_steps and step % config.save_steps == 0 and step != config.max_steps:
                self.save(step, history)
        self.save(config.max_steps, history)
        export_dir = self.cluster.export_hf(config.model_export_dir)[0]
        tracker.close()
        before, after = history[0]["val/preference_accuracy"], history[-1]["val/preference_accuracy"]
        summary = {"val_pairwise_accuracy_before": before, "val_pairwise_accuracy_after": after}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"logs and TensorBoard events in {tracker.log_dir}; reward model exported to {export_dir}", flush=True)
        print(f"held-out pairwise accuracy {before:.2f} -> {after:.2f}", flush=True)
        return summary
