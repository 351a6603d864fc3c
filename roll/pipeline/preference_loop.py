"""The driver loop of a pipeline trained on preference data: steps, held-out evaluation, checkpoints, resume, export.

A subclass (DPO, the reward model) starts its clusters and supplies one step, the held-out
evaluation and how their numbers are shown.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from roll.datasets.preference_formats import encode_examples, load_format_splits
from roll.datasets.prompt_dataset import PromptSampler, pad_token_id
from roll.distributed.scheduler.protocol import DataProto
from roll.models.model_providers import load_tokenizer
from roll.models.tiny import resolve_model_path
from roll.pipeline import checkpoint_state
from roll.pipeline.base_pipeline import BasePipeline
from roll.pipeline.preference_config import PreferenceRunConfig
from roll.pipeline.run_tracking import open_run_tracker
from roll.utils.tracking import show_progress


class PreferenceRunPipeline(BasePipeline):
    """Trains `trained_role` on batches of examples for `max_steps`, evaluating before, every `eval_steps` and after."""

    config: PreferenceRunConfig
    trained_role: str
    progress_label: str

    def __init__(self, config: PreferenceRunConfig) -> None:
        super().__init__(config)
        for role in config.roles().values():
            resolve_model_path(role.model_args.model_name_or_path)  # build tiny models once, here
        tokenizer = load_tokenizer(config.roles()[self.trained_role].model_args.model_name_or_path)
        self.pad_id = pad_token_id(tokenizer)
        train, held_out = load_format_splits(config.data, tokenizer, config.max_response_length)
        self.sampler = PromptSampler(train, config.batch_size, config.seed)
        self.eval_batch = self.encode(held_out[: config.eval_batch_size or None])
        self.run_dir = Path(config.run_dir)

    def encode(self, examples: list) -> DataProto:
        """`examples` of `data.format` as the rows the models score (a pair is two rows: chosen, rejected)."""
        return encode_examples(examples, self.config.data.format, self.pad_id)

    def step(self) -> dict[str, float]:
        """One optimizer step on the next batch of examples; its metrics."""
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics of the trained model."""
        raise NotImplementedError

    def postfix(self, metrics: dict[str, float], evaluation: dict[str, float]) -> dict[str, str]:
        """What the progress bar shows after a step: its `metrics` and the latest `evaluation`."""
        raise NotImplementedError

    def summarize(self, before: dict[str, float], after: dict[str, float]) -> tuple[dict[str, float], str]:
        """The run's summary (summary.json) and its printed line, from the first and the last evaluation."""
        raise NotImplementedError

    def enter_training(self) -> None:
        """Make the trained role's states resident (before its checkpoints); subclasses sharing devices override."""

    def save(self, step: int, history: list[dict[str, float]]) -> str:
        """Checkpoint the trained role and the driver's state at `step`; return the checkpoint path."""
        root, tag = self.config.checkpoint_root, f"step_{step}"
        self.enter_training()
        self.clusters[self.trained_role].save_checkpoint(str(root / self.trained_role), tag)
        state = {"step": step, "sampler": self.sampler.state_dict(), "val_history": history}
        return checkpoint_state.save_driver_state(root, tag, state)

    def resume(self) -> dict:
        """Restore the trained role and the driver state from `resume_from_checkpoint`; return the driver state."""
        root = self.config.checkpoint_root
        state = checkpoint_state.load_driver_state(root, self.config.resume_tag)
        self.enter_training()
        self.clusters[self.trained_role].load_checkpoint(str(root / self.trained_role), f"step_{state['step']}")
        self.sampler.load_state_dict(state["sampler"])
        return state

    def run(self) -> dict[str, float]:
        """Train for `max_steps`, checkpoint, export; print and return the held-out summary before and after."""
        config = self.config
        start_step, history = 0, []
        if config.resume_from_checkpoint:
            state = self.resume()
            start_step, history = state["step"], state["val_history"]
        tracker = open_run_tracker(config, start_step)
        if not start_step:
            history.append(self.evaluate())
            tracker.log(history[-1], 0)
        progress = show_progress(range(start_step + 1, config.max_steps + 1), desc=self.progress_label)
        for step in progress:
            started = time.perf_counter()
            metrics = self.step()
            if step % config.eval_steps == 0 or step == config.max_steps:
                history.append(self.evaluate())
                metrics.update(history[-1])
            metrics["time/step_s"] = time.perf_counter() - started
            tracker.log(metrics, step)
            progress.set_postfix(**self.postfix(metrics, history[-1]))
            if config.save_steps and step % config.save_steps == 0 and step != config.max_steps:
                self.save(step, history)
        self.save(config.max_steps, history)
        export_dir = self.clusters[self.trained_role].export_hf(config.model_export_dir)[0]
        tracker.close()
        summary, line = self.summarize(history[0], history[-1])
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"logs and TensorBoard events in {tracker.log_dir}; model exported to {export_dir}", flush=True)
        print(line, flush=True)
        return summary
