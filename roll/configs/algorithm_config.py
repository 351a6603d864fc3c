"""The RL algorithm's settings: advantages, KL, the PPO loss and reward shaping.

One schema for the driver (advantages, KL penalty) and the workers (the losses read it directly).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from roll.configs.schema import ConfigError, check

KLKind = Literal["k1", "k2", "k3", "abs"]


@dataclass
class AlgorithmArguments:
    """Advantages, KL, PPO loss and reward shaping.

    `whiten_advantages` (gae only): whiten the GAE advantages over the batch's response tokens (mean 0,
    unit variance) before the PPO loss, as PPO implementations commonly do; the critic's value targets
    stay unwhitened. `kl_loss_kind` is the estimator of the KL loss (`use_kl_loss`, `kl_loss_coef`),
    `kl_penalty_kind` that of the KL reward penalty (`kl_penalty_coef`, `adaptive_kl_target`); the
    adaptive controller scales `kl_penalty_coef`, so it needs a positive start value. k1 is refused as the
    loss's estimator: its expected gradient on the policy's own samples is 0 (it stays fine as a penalty).
    `log_prob_temperature`: "one" scores tokens under the model's own distribution (TRL's and
    OpenRLHF's default); "sampling" divides the logits by actor_infer's sampling temperature first
    (verl's choice), so old, reference and current log-probs are those of the distribution the samples
    came from. They differ only when sampling at a temperature other than 1.
    Variants of current practice (docs/algorithms.md): `loss_agg_mode="seq-mean-token-sum-norm"` divides each
    sequence's loss sum by the maximum response length (Dr. GRPO); `importance_level="sequence"` uses one
    clipped ratio per sequence, the geometric mean of its token ratios (GSPO); `tis_cap` weights the
    policy loss by `min(exp(old_logp - engine_logp), tis_cap)` against the generating engine's own log-probs
    (truncated importance sampling); `overlong_filter` gives responses cut at max_new_tokens without EOS no
    loss, `overlong_buffer_len` adds DAPO's linear penalty, down to `-overlong_penalty_factor`, over the last
    `overlong_buffer_len` tokens before max_new_tokens to the score.
    `old_log_probs_pass`: "auto" skips actor_train's separate old log-probs pass on the steps where it
    would score the same weights the update starts from (ppo_epochs 1, the whole rollout one optimizer
    step, no KL reward penalty, which reads them before the update): the update takes them from its own
    forward pass, detached, so the ratio is 1 (as TRL does with one iteration). "always" runs the pass
    every step, for ablations or to reproduce earlier runs bit for bit (the two differ by rounding).
    On-policy distillation (docs/distillation.md): with `teacher_kl_coef` > 0 the RLVR `teacher` role scores
    the sampled responses and every response token's reward gains `teacher_kl_coef * (log p_teacher(y_t) -
    log p_actor(y_t))`, the negative per-token reverse KL to the teacher (k1, at the sampling policy's
    log-probs); `score_weight` scales the verifiable score (0: the teacher's signal replaces it).
    """

    adv_estimator: Literal["gae", "grpo", "reinforce_plus_plus", "rloo"] = "grpo"
    gamma: float = field(default=1.0, metadata=check(ge=0, le=1))
    lam: float = field(default=0.95, metadata=check(ge=0, le=1))
    norm_adv_by_std: bool = True
    whiten_advantages: bool = False
    ppo_epochs: int = field(default=1, metadata=check(ge=1))
    # The ratio's floor 1 - clip_low must stay positive.
    clip_low: float = field(default=0.2, metadata=check(gt=0, lt=1))
    clip_high: float = field(default=0.28, metadata=check(gt=0))
    dual_clip: float | None = field(default=None, metadata=check(gt=1, hint="leave it unset (null) for no dual clip"))
    value_clip: float | None = field(default=0.5, metadata=check(gt=0, hint="null turns value clipping off"))
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    importance_level: Literal["token", "sequence"] = "token"
    tis_cap: float | None = field(
        default=None, metadata=check(gt=0, hint="null turns truncated importance sampling off; e.g. 2.0")
    )
    overlong_filter: bool = False
    overlong_buffer_len: int | None = field(
        default=None, metadata=check(ge=1, hint="null turns the overlong penalty off; e.g. 512")
    )
    overlong_penalty_factor: float = field(default=1.0, metadata=check(ge=0))
    entropy_coef: float = field(default=0.0, metadata=check(ge=0))
    kl_loss_kind: KLKind = "k3"
    kl_penalty_kind: KLKind = "k3"
    use_kl_loss: bool = False
    kl_loss_coef: float = field(default=0.0, metadata=check(ge=0))
    kl_penalty_coef: float = field(default=0.0, metadata=check(ge=0))
    adaptive_kl_target: float | None = field(
        default=None, metadata=check(gt=0, hint="null keeps the coefficient fixed")
    )
    adaptive_kl_horizon: int = field(default=10000, metadata=check(ge=1))
    teacher_kl_coef: float = field(default=0.0, metadata=check(ge=0, hint="0 turns on-policy distillation off"))
    score_weight: float = field(default=1.0, metadata=check(ge=0))
    reward_norm: Literal["none", "group", "batch"] = "none"
    reward_clip: float | None = field(default=None, metadata=check(gt=0, hint="null turns reward clipping off"))
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = field(
        default=1,
        metadata=check(
            ge=1,
            hint="1 trains the informative groups of one generation (the batch may shrink); more generate again, "
            "up to that many rounds, until the batch is full (DAPO)",
        ),
    )
    log_prob_temperature: Literal["one", "sampling"] = "one"
    old_log_probs_pass: Literal["auto", "always"] = "auto"

    def __post_init__(self) -> None:
        """Reject combinations that cannot work, naming the field to change."""
        if self.dynamic_sampling_max_rounds > 1 and not self.dynamic_sampling:
            raise ConfigError(
                f"algorithm.dynamic_sampling_max_rounds={self.dynamic_sampling_max_rounds} refills a batch that "
                "dynamic sampling shrank, and algorithm.dynamic_sampling is false; set it to true or drop the rounds"
            )
        if self.use_kl_loss and self.kl_loss_kind == "k1":
            raise ConfigError(
                "algorithm.kl_loss_kind=k1 with algorithm.use_kl_loss=true: as a loss, k1 = log p - log p_ref has "
                "zero expected gradient (on samples of the policy its gradient is the score function, whose mean is "
                "0), so the KL term only adds noise; use k3 (non-negative, low variance: GRPO's choice) or k2 (its "
                "expected gradient is that of KL(p || p_ref)). k1 stays the usual estimator of the reward penalty "
                "(algorithm.kl_penalty_kind)"
            )
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
    def needs_teacher(self) -> bool:
        """On-policy distillation needs the teacher's log-probs of the samples."""
        return self.teacher_kl_coef > 0

    @property
    def needs_reference(self) -> bool:
        """A reference model is needed for a KL loss or a KL reward penalty."""
        return self.use_kl_loss or self.kl_penalty_coef > 0 or self.adaptive_kl_target is not None
