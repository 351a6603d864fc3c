"""The algorithm math: pure torch functions over response tokens, each stating its invariant.

- `advantages`: advantage estimators registered by name (GAE, GRPO, RLOO, REINFORCE++, ...).
- `policy_losses`: PPO/GSPO policy and value losses, loss aggregation modes, truncated importance sampling.
- `kl`: per-token KL estimators (k1, k2, k3), the KL controllers and the reward penalty.
- `reward_shaping`: sequence-score processing (group normalisation, clipping, overlong penalty, dynamic sampling).
- `preference_losses`: DPO, IPO, cDPO and KTO.
- `reward_model_losses`, `process_reward_losses`: Bradley-Terry and a process reward model's step loss.
- `distillation_losses`: top-k forward, reverse and mixed KL against a teacher.

May import: `roll.utils` only (no configs, no Ray, no backends), so every function is unit-testable alone.
"""
