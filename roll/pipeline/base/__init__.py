"""What every pipeline builds on. A new pipeline family is a package beside this one that brings:

- a config dataclass extending `PipelineConfig` (`pipeline_config`), or `TrainingRunConfig` for a
  step-by-step training run (`training_config`), with its own `validate()` checks and roles;
- a driver extending `BasePipeline` (`pipeline`), or `TrainingRunPipeline` (`training_loop`), which
  then only supplies `step()`, `evaluate()` and how their numbers are shown;
- its workers, when the RL roles here do not fit, as `StrategyWorker` subclasses named in YAML;
- an entry point: `examples/start_<name>_pipeline.py` calling `entry.run_pipeline`.

What it gets for free:

- `entry`: Hydra config -> strict dataclasses -> validation -> dry run or run, clear exit codes;
- `pipeline`: Ray connection, device reservation, one cluster per role, orderly shutdown;
- `rl_workers`, `reward_model_worker`: the actor (train, infer, reference), the critic and the
  outcome and process reward-model scorers, with their losses from `roll.algorithms`;
- `residency`: which roles' states each phase needs on the devices, offloading the others;
- `checkpoint_state`, `resumable`: the driver's part of a checkpoint, `keep_last_n` and `resume_from_checkpoint`;
- `fault_tolerance_config`, `recovery`, `preemption`: restarts after a lost worker or node, and the stop with a
  checkpoint on SIGTERM/SIGINT (docs/fault_tolerance.md);
- `training_loop`, `preference_config`, `preference_loop`: the loop of steps, held-out evaluation,
  checkpoints, resume and export, and preference-pair data on top of it;
- `rollout_batches`: rollouts of prompt batches of different widths put together;
- `evaluation`: greedy held-out accuracy (the run's metrics go to `roll.utils.tracking.MetricsTracker.for_run`);
- `teacher_checks`: the checks of a teacher role (distillation);
- `dry_run`: the placement plan, the batch arithmetic and the memory estimate, without Ray.

May import: every layer below `roll.pipeline`; never a pipeline family.
"""
