"""Learning-rate schedules as multipliers of the base rate, for torch's LambdaLR."""

from __future__ import annotations

import math
from collections.abc import Callable

from roll.configs.worker_config import TrainingArguments


def lr_lambda(args: TrainingArguments) -> Callable[[int], float]:
    """Multiplier of the base learning rate at each optimizer step: warm-up, then the chosen decay."""

    def multiplier(step: int) -> float:
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        if args.lr_scheduler_type == "constant":
            return 1.0
        progress = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
        if args.lr_scheduler_type == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier
