"""Workers the global-batch loss test drives; Ray workers import them by module path.

They are roll's actor and process reward workers that also hand back the gradients of their last optimizer
step, as DeepSpeed averaged them over the data-parallel ranks (ZeRO stage 0: every rank holds them whole).
"""

from __future__ import annotations

import torch

from roll.distributed.executor.strategy_worker import StrategyWorker
from roll.distributed.scheduler.decorator import Dispatch, register
from roll.pipeline.base.rl_workers import ActorWorker
from roll.pipeline.rm.prm_worker import ProcessRewardTrainWorker


class GradientRecorder(StrategyWorker):
    """Keeps the gradients every optimizer step applies, read when the engine steps at an accumulation boundary
    (before clipping)."""

    @register(Dispatch.ONE_TO_ALL)
    def record_gradients(self) -> None:
        engine = self.strategy.engine
        step = engine.step

        def recording_step(*args, **kwargs):
            if engine.is_gradient_accumulation_boundary():
                parameters = engine.module.named_parameters()
                self.gradients = {name: p.grad.detach().clone() for name, p in parameters if p.grad is not None}
            return step(*args, **kwargs)

        engine.step = recording_step

    @register(Dispatch.ONE_TO_ALL)
    def last_gradients(self) -> dict[str, torch.Tensor]:
        return self.gradients


class ActorGradientWorker(GradientRecorder, ActorWorker):
    """ActorWorker (PPO and SFT updates) that records its gradients."""


class ProcessRewardTrainGradientWorker(GradientRecorder, ProcessRewardTrainWorker):
    """ProcessRewardTrainWorker (the step BCE) that records its gradients."""
