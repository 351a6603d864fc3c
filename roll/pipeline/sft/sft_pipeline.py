"""Supervised fine-tuning on demonstrations, on the same strategy layer as RL; ends with a HF export."""

from __future__ import annotations

import json
import time
from pathlib import Path

from roll.configs.worker_config import GeneratingArguments
from roll.datasets.prompt_dataset import encode_demonstrations, load_splits, make_sampler, pad_token_id
from roll.models.model_providers import load_tokenizer
from roll.models.processors import processor_for
from roll.models.tiny import resolve_model_path
from roll.pipeline.base.evaluation import answer_scorer, greedy_accuracy
from roll.pipeline.base.pipeline import BasePipeline
from roll.pipeline.sft.sft_config import SFTConfig
from roll.utils.tracking import MetricsTracker, show_progress, timed_evaluation

EXPORT_MARKER = "roll_sft.json"


def exported_accuracy(export_dir: str) -> float | None:
    """Held-out accuracy recorded by a finished export, or None when there is none."""
    marker = Path(export_dir) / EXPORT_MARKER
    return json.loads(marker.read_text())["val_accuracy"] if marker.is_file() else None


class SFTPipeline(BasePipeline):
    """Trains `actor_train` on (prompt, answer) demonstrations and writes `export_dir`."""

    config: SFTConfig

    def __init__(self, config: SFTConfig) -> None:
        super().__init__(config)
        model_path = resolve_model_path(config.actor_train.model_args.model_name_or_path)
        self.tokenizer = load_tokenizer(model_path)
        self.pad_id = pad_token_id(self.tokenizer)
        self.train_examples, self.eval_examples = load_splits(
            config.data, self.tokenizer, config.max_response_length, processor_for(model_path)
        )
        self.sampler = make_sampler(self.train_examples, config.batch_size, config.seed, config.data.domain_weights)
        self.generating_args = GeneratingArguments(max_new_tokens=config.max_response_length)

    def evaluate(self) -> float:
        """Greedy held-out accuracy of the model being trained."""
        accuracy, _ = greedy_accuracy(
            self.clusters["actor_train"],
            self.eval_examples,
            self.pad_id,
            self.generating_args,
            answer_scorer(self.tokenizer),
        )
        return accuracy

    @classmethod
    def finished_result(cls, config: SFTConfig) -> float | None:
        """With `skip_if_exported`, the held-out accuracy of a finished export in `export_dir` (None: train)."""
        accuracy = exported_accuracy(config.model_export_dir) if config.skip_if_exported else None
        if accuracy is not None:
            print(f"SFT model already exported in {config.model_export_dir} (val accuracy {accuracy:.2f})")
        return accuracy

    def held_out_metrics(self) -> dict[str, float]:
        """`evaluate()` as a metric."""
        return {"val/accuracy": self.evaluate()}

    def run(self) -> float:
        """Train, evaluate every `eval_steps`, export; return the final held-out accuracy."""
        config = self.config
        actor = self.start_cluster("actor_train")
        actor.initialize()
        tracker = MetricsTracker.for_run(config)
        progress = show_progress(range(1, config.max_steps + 1), desc="sft")
        evaluation = timed_evaluation(self.held_out_metrics, 0)
        accuracy = evaluation["val/accuracy"]
        tracker.log(evaluation, 0)
        for step in progress:
            started = time.perf_counter()
            batch = encode_demonstrations(self.sampler.next_batch(), self.pad_id)
            metrics = actor.sft_step(batch)[0]
            metrics["time/step_s"] = time.perf_counter() - started
            if step % config.eval_steps == 0 or step == config.max_steps:
                metrics.update(timed_evaluation(self.held_out_metrics, step))
                accuracy = metrics["val/accuracy"]
            tracker.log(metrics, step)
            progress.set_postfix(loss=f"{metrics['loss']:.3f}", val_acc=f"{accuracy:.2f}")
        tracker.close()
        export_dir = config.model_export_dir
        actor.export_hf(export_dir)
        (Path(export_dir) / EXPORT_MARKER).write_text(json.dumps({"val_accuracy": accuracy, "steps": config.max_steps}))
        print(f"SFT done: val accuracy {accuracy:.2f}; model exported to {export_dir}", flush=True)
        return accuracy
