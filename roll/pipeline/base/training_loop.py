"""The driver loop of a step-by-step training run: steps, held-out evaluation, checkpoints, resume, export.

A subclass (DPO, the reward model, distillation) loads its data into `sampler`, starts its clusters
and supplies one step, the held-out evaluation and how their numbers are shown.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Protocol

from roll.models.tiny import resolve_model_path
from roll.pipeline.base import checkpoint_state
from roll.pipeline.base.pipeline import BasePipeline
from roll.pipeline.base.preemption import Preempted
from roll.pipeline.base.residency import Phase
from roll.pipeline.base.training_config import TrainingRunConfig
from roll.utils.tracking import MetricsTracker, show_progress, timed_evaluation


class BatchSampler(Protocol):
    """Endless training batches whose position is part of a checkpoint (`roll.datasets` samplers)."""

    def next_batch(self) -> list[Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def before_after_summary(before: dict[str, float], after: dict[str, float], *names: str) -> dict[str, float]:
    """`val_<name>_before` and `val_<name>_after` of each held-out metric `val/<name>`, name by name."""
    return {
        f"val_{name}_{when}": values[f"val/{name}"]
        for name in names
        for when, values in (("before", before), ("after", after))
    }


def progress_postfix(loss: float, val_acc: float, **batch_metric: str) -> dict[str, str]:
    """The progress bar's postfix of a step: its loss, `batch_metric` (formatted) and the latest held-out accuracy."""
    return {"loss": f"{loss:.3f}", **batch_metric, "val_acc": f"{val_acc:.2f}"}


class TrainingRunPipeline(BasePipeline):
    """Trains `trained_role` on `sampler`'s batches for `max_steps`, evaluating before, every `eval_steps` and after."""

    config: TrainingRunConfig
    trained_role: str
    progress_label: str
    sampler: BatchSampler
    # The phase `trained_role` trains in, for a run whose roles take turns on devices (`start_roles`).
    training_phase: Phase | None = None

    def __init__(self, config: TrainingRunConfig) -> None:
        super().__init__(config)
        for role in config.roles().values():
            resolve_model_path(role.model_args.model_name_or_path)  # build tiny models once, here
        self.run_dir = Path(config.run_dir)

    def step(self) -> dict[str, float]:
        """One optimizer step on the next batch; its metrics."""
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
        """Make the trained role's states resident (before its checkpoints): enter `training_phase`, if any."""
        if self.training_phase is not None:
            self.residency.enter(self.training_phase)

    def save(self, step: int, history: list[dict[str, float]]) -> str:
        """Checkpoint the trained role and the driver's state at `step`; return the checkpoint path."""
        config = self.config
        root, tag = config.checkpoint_root, f"step_{step}"
        self.enter_training()
        self.clusters[self.trained_role].save_checkpoint(str(root / self.trained_role), tag)
        state = {
            "step": step,
            "sampler": self.sampler.state_dict(),
            "val_history": history,
            checkpoint_state.ROLES: [self.trained_role],
        }
        return checkpoint_state.save_driver_state(root, tag, state, config.keep_last_n)

    def resume(self) -> dict:
        """Restore the trained role and the driver state from `resume_from_checkpoint`; return the driver state."""
        root = self.config.resume_root
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
        tracker = MetricsTracker.for_run(config, start_step)
        if not start_step:
            history.append(timed_evaluation(self.evaluate, 0))
            tracker.log(history[-1], 0)
        progress = show_progress(range(start_step + 1, config.max_steps + 1), desc=self.progress_label)
        for step in progress:
            started = time.perf_counter()
            metrics = self.step()
            if step % config.eval_steps == 0 or step == config.max_steps:
                history.append(timed_evaluation(self.evaluate, step))
                metrics.update(history[-1])
            metrics["time/step_s"] = time.perf_counter() - started
            metrics.update(self.fault_metrics)
            tracker.log(metrics, step)
            progress.set_postfix(**self.postfix(metrics, history[-1]))
            saved = None
            if config.save_steps and step % config.save_steps == 0 and step != config.max_steps:
                saved = self.save(step, history)
            if self.stop_requested and step != config.max_steps:
                raise Preempted(step, saved or self.save(step, history))
        self.save(config.max_steps, history)
        export_dir = self.clusters[self.trained_role].export_hf(config.model_export_dir)[0]
        plots = tracker.close()
        summary, line = self.summarize(history[0], history[-1])
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(
            f"logs, TensorBoard events and plots ({len(plots)} PNG) in {tracker.log_dir}; model exported to "
            f"{export_dir}",
            flush=True,
        )
        print(line, flush=True)
        return summary
