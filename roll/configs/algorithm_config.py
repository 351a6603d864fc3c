"""The RL algorithm's settings: advantages, KL, the PPO loss and reward shaping.

One schema for the driver (advantages, KL penalty) and the workers (the losses read it directly).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from roll.configs.schema import ConfigError

KLKind = Literal["k1", "k2", "k3", "abs"]


@dataclass
class AlgorithmArguments:
    """Advantages, KL, PPO loss and reward shaping.

    `whiten_advantages` (gae only): whiten the GAE advantages over the batch's response tokens (mean 0,
    unit variance) before the PPO loss, as PPO implementations commonly do; the critic's value targets
    stay unwhitened. `kl_loss_kind` is the estimator of the KL loss (`use_kl_loss`, `kl_loss_coef`),
    `kl_penalty_kind` that of the KL reward penalty (`kl_penalty_coef`, `adaptive_kl_target`); the
    adaptive controller scales `kl_penalty_coef`, so it needs a positive start value.
    """

    adv_estimator: Literal["gae", "grpo", "reinforce_plus_plus", "rloo"] = "grpo"
    gamma: float = 1.0
    lam: float = 0.95
    norm_adv_by_std: bool = True
    whiten_advantages: bool = False
    ppo_epochs: int = 1
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    value_clip: float | None = 0.5
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    entropy_coef: float = 0.0
    kl_loss_kind: KLKind = "k3"
    kl_penalty_kind: KLKind = "k3"
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_penalty_coef: float = 0.0
    adaptive_kl_target: float | None = None
    adaptive_kl_horizon: int = 10000
    reward_norm: Literal["none", "group", "batch"] = "none"
    reward_clip: float | None = None
    dynamic_sampling: bool = False

    def __post_init__(self) -> None:
        """Reject combinations that cannot work, naming the field to change."""
        if self.adaptive_kl_target is not None and self.kl_penalty_coef <= 0:
            raise ConfigError(
                f"algorithm.kl_penalty_coef={self.kl_penalty_coef} with "
                f"algorithm.adaptive_kl_target={self.adaptive_kl_target}: the adaptive controller multiplies the "
                "coefficient, so it would never leave 0; set algorithm.kl_penalty_coef to a positive start value "
                "(e.g. 0.001) or drop algorithm.adaptive_kl_target"
            )
        if self.whiten_advantages and self.adv_estimator != "gae":
            raise ConfigError(
                f"algorithm.whiten_advantages applies to adv_estimator=gae only, not {self.adv_estimator!r} "
                "(grpo and rloo normalise per group, reinforce_plus_plus already whitens); set it to false"
            )

    @property
    def needs_reference(self) -> bool:
        """A reference model is needed for a KL loss or a KL reward penalty."""
        return self.use_kl_loss or self.kl_penalty_coef > 0 or self.adaptive_kl_target is not None
