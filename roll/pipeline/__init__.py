"""The driver loops, one package per pipeline family, on one shared base.

- `base/`: what every pipeline builds on (config, Ray start-up, the RL worker roles, residency,
  checkpoints and resume, the training loop, evaluation, tracking, the dry run); its docstring says
  what a new pipeline implements and what it gets for free.
- `rlvr/`, `sft/`, `dpo/`, `rm/`, `distill/`, `cluster_check/`: the pipeline families, each with its
  config, its driver and its workers.

May import: every layer below (`roll.distributed.*`, `roll.models`, `roll.datasets`, `roll.rewards`,
`roll.algorithms`, `roll.configs`, `roll.platforms`, `roll.utils`). A family imports `base` and never
another family.
"""
