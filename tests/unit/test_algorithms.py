"""Hand-computed checks of the RLVR algorithm functions: advantages, KL, PPO losses, score processing."""

from __future__ import annotations

import math

import pytest
import torch

from roll.algorithms.advantages import ADVANTAGE_ESTIMATORS, get_advantage_estimator
from roll.algorithms.kl import AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_estimate
from roll.algorithms.policy_losses import aggregate_loss, entropy_from_logits, kl_loss, policy_loss, value_loss
from roll.algorithms.reward_shaping import (
    clip_scores,
    dynamic_sampling_keep,
    group_index_from_repeat,
    normalize_scores,
)
from roll.configs.algorithm_config import AlgorithmArguments
from roll.configs.schema import ConfigError
from roll.utils.functionals import group_stats


def t(*rows: object) -> torch.Tensor:
    """A float64 tensor, so hand-computed numbers compare tightly."""
    return torch.tensor(rows, dtype=torch.float64)


def close(actual: torch.Tensor, expected: object, atol: float = 1e-5) -> None:
    """`actual` equals `expected` (a tensor or nested lists/numbers) within `atol`."""
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# --- advantages -------------------------------------------------------------------------------------------


def test_registry_names_and_unknown_name() -> None:
    assert set(ADVANTAGE_ESTIMATORS) == {"gae", "grpo", "reinforce_plus_plus", "rloo"}
    with pytest.raises(ValueError, match=r"'gae', 'grpo', 'reinforce_plus_plus', 'rloo'"):
        get_advantage_estimator("ppo2")


def test_gae_hand_computed_with_padding_and_hole() -> None:
    # Row 0: gamma=0.9, lam=0.8 (gamma*lam = 0.72), r = [0, 0, 1], V = [0.5, 0.6, 0.7], then one pad token.
    #   t2: delta = 1 - 0.7 = 0.3                   A2 = 0.3
    #   t1: delta = 0.9*0.7 - 0.6 = 0.03            A1 = 0.03 + 0.72*0.3   = 0.246
    #   t0: delta = 0.9*0.6 - 0.5 = 0.04            A0 = 0.04 + 0.72*0.246 = 0.21712
    # Row 1: the same tokens with a masked hole at t1 (reward 7, value 9 ignored): the recursion skips it.
    rewards = t([0.0, 0.0, 1.0, 5.0], [0.0, 7.0, 0.0, 1.0])
    values = t([0.5, 0.6, 0.7, 3.0], [0.5, 9.0, 0.6, 0.7])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]])
    adv, ret = get_advantage_estimator("gae")(rewards, mask, values=values, gamma=0.9, lam=0.8)
    close(adv, [[0.21712, 0.246, 0.3, 0.0], [0.21712, 0.0, 0.246, 0.3]])
    close(ret, [[0.71712, 0.846, 1.0, 0.0], [0.71712, 0.0, 0.846, 1.0]])


def test_gae_needs_values() -> None:
    with pytest.raises(ValueError, match="needs values"):
        get_advantage_estimator("gae")(t([1.0]), torch.ones(1, 1))


def test_grpo_two_groups_singleton_and_constant_group() -> None:
    # Interleaved groups with arbitrary ids: 10 -> scores [1, 2, 3] (mean 2, unbiased std 1 -> [-1, 0, 1]);
    # 3 -> [5, 5] (std 0 -> 0); 42 -> [7] alone -> 0. Row 0's score 1 is spread over two tokens.
    rewards = t([0.5, 0.5, 0.0], [5.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 5.0], [0.0, 0.0, 3.0], [7.0, 0.0, 0.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]])
    group_index = torch.tensor([10, 3, 10, 3, 10, 42])
    adv, ret = get_advantage_estimator("grpo")(rewards, mask, group_index=group_index)
    expected_seq = [-1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    close(adv, torch.tensor(expected_seq, dtype=torch.float64).unsqueeze(-1) * mask)
    close(ret, adv)
    for group in group_index.unique():
        rows = group_index == group
        close(adv[rows][:, 0].sum(), 0.0)


def test_grpo_mean_only_dr_grpo() -> None:
    # Group [0, 4]: mean 2 -> [-2, 2] without dividing by std (which would give -+sqrt(2)).
    adv, _ = get_advantage_estimator("grpo")(
        t([0.0, 0.0], [0.0, 4.0]), torch.ones(2, 2), group_index=torch.tensor([0, 0]), norm_by_std=False
    )
    close(adv, [[-2.0, -2.0], [2.0, 2.0]])


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_group_estimators_need_group_index(name: str) -> None:
    with pytest.raises(ValueError, match="group_index"):
        get_advantage_estimator(name)(t([1.0]), torch.ones(1, 1))


def test_rloo_leave_one_out() -> None:
    # Group 0 scores [1, 2, 3]: baselines mean(2,3)=2.5, mean(1,3)=2, mean(1,2)=1.5 -> [-1.5, 0, 1.5].
    # Group 1 scores [0, 4]: baselines 4 and 0 -> [-4, 4]. Group 2 alone -> 0.
    rewards = t([1.0, 0.0], [0.0, 0.0], [2.0, 0.0], [0.0, 4.0], [0.0, 3.0], [9.0, 0.0])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1], [1, 1], [1, 0]])
    group_index = torch.tensor([0, 1, 0, 1, 0, 2])
    adv, ret = get_advantage_estimator("rloo")(rewards, mask, group_index=group_index)
    close(adv, [[-1.5, -1.5], [-4.0, -4.0], [0.0, 0.0], [4.0, 4.0], [1.5, 1.5], [0.0, 0.0]])
    close(ret, adv)


def test_reinforce_plus_plus_return_to_go_then_whitened() -> None:
    # gamma = 0.5. Row 0: r = [0, 0.5, 3] -> G = [1, 2, 3] (G2 = 3, G1 = 0.5 + 1.5, G0 = 0 + 1).
    # Row 1: r = [2.5, 1, pad 7] -> G = [3, 1, 0]. Tokens {1, 2, 3, 3, 1}: mean 2, squared deviations
    # 1+0+1+1+1 = 4, unbiased var 4/4 = 1 -> advantages = G - 2.
    rewards = t([0.0, 0.5, 3.0], [2.5, 1.0, 7.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = get_advantage_estimator("reinforce_plus_plus")(rewards, mask, gamma=0.5)
    close(ret, [[1.0, 2.0, 3.0], [3.0, 1.0, 0.0]])
    close(adv, [[-1.0, 0.0, 1.0], [1.0, -1.0, 0.0]])
    close(adv[mask.bool()].sum(), 0.0)


def test_reinforce_plus_plus_nearly_equal_returns_give_near_zero_advantages() -> None:
    # Returns 1 and 1 + 2e-7 (rounding noise): mean 1 + 1e-7, deviations -+1e-7, unbiased var 2e-14.
    # A variance epsilon keeps the noise small: -+1e-7 / sqrt(1e-8 + 2e-14) = -+1e-3 (to 1e-9), where
    # dividing by std + 1e-8 would give -+1e-7 / (1.41e-7 + 1e-8) = -+0.66.
    adv, _ = get_advantage_estimator("reinforce_plus_plus")(t([1.0], [1.0 + 2e-7]), torch.ones(2, 1))
    close(adv, [[-1e-3], [1e-3]], atol=1e-8)


def test_gae_whitened_over_masked_tokens() -> None:
    # gamma = lam = 1, V = 0: A = return-to-go. Row 0: r = [0, 1, pad 9] -> A = [1, 1]; row 1: [0, 0, 3] -> [3, 3, 3].
    # Tokens {1, 1, 3, 3, 3}: mean 2.2, squared deviations 2 * 1.44 + 3 * 0.64 = 4.8, unbiased var 1.2, so
    # -1.2 -> -1.2 / sqrt(1.2) = -sqrt(1.2) and 0.8 -> 0.8 / sqrt(1.2). Returns stay A + V (not whitened).
    rewards = t([0.0, 1.0, 9.0], [0.0, 0.0, 3.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    gae = get_advantage_estimator("gae")
    adv, ret = gae(rewards, mask, values=torch.zeros_like(rewards), gamma=1.0, lam=1.0, whiten=True)
    low, high = -math.sqrt(1.2), 0.8 / math.sqrt(1.2)
    close(adv, [[low, low, 0.0], [high, high, high]])
    close(ret, [[1.0, 1.0, 0.0], [3.0, 3.0, 3.0]])
    plain, _ = gae(rewards, mask, values=torch.zeros_like(rewards), gamma=1.0, lam=1.0)
    close(plain, [[1.0, 1.0, 0.0], [3.0, 3.0, 3.0]])


def test_whiten_advantages_is_for_gae_only() -> None:
    assert not AlgorithmArguments().whiten_advantages
    AlgorithmArguments(adv_estimator="gae", whiten_advantages=True)
    with pytest.raises(ConfigError, match=r"algorithm\.whiten_advantages.*gae"):
        AlgorithmArguments(adv_estimator="grpo", whiten_advantages=True)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_estimators_zero_outside_mask(name: str) -> None:
    torch.manual_seed(0)
    rewards, values = torch.randn(4, 5), torch.randn(4, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    adv, ret = get_advantage_estimator(name)(
        rewards, mask, values=values, group_index=torch.tensor([0, 0, 1, 1]), gamma=0.9, lam=0.95
    )
    assert adv.shape == ret.shape == (4, 5)
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)


# --- KL ---------------------------------------------------------------------------------------------------


def test_kl_estimators_hand_computed() -> None:
    # d = logp - ref = [ln 2, -ln 2, 0].
    logp = t(math.log(2.0), 0.0, -1.0)
    ref = t(0.0, math.log(2.0), -1.0)
    ln2 = math.log(2.0)
    close(kl_estimate(logp, ref, "k1"), [ln2, -ln2, 0.0])
    close(kl_estimate(logp, ref, "k2"), [0.5 * ln2**2, 0.5 * ln2**2, 0.0])
    # k3 = exp(-d) + d - 1: d = ln 2 -> 1/2 + ln 2 - 1; d = -ln 2 -> 2 - ln 2 - 1.
    close(kl_estimate(logp, ref, "k3"), [ln2 - 0.5, 1.0 - ln2, 0.0])
    close(kl_estimate(logp, ref, "abs"), [ln2, ln2, 0.0])
    with pytest.raises(ValueError, match="'k1', 'k2', 'k3', 'abs'"):
        kl_estimate(logp, ref, "k4")  # type: ignore[arg-type]


def test_kl_controllers() -> None:
    fixed = FixedKLController(0.05)
    fixed.update(current_kl=100.0, n_steps=10)
    assert fixed.value == 0.05
    # target 6, horizon 10000, 500 steps. KL 9: error 0.5 clipped to 0.2 -> 0.1 * (1 + 0.2*0.05) = 0.101.
    # KL 5.4: error -0.1 -> 0.101 * (1 - 0.1*0.05) = 0.101 * 0.995 = 0.100495.
    adaptive = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    adaptive.update(current_kl=9.0, n_steps=500)
    assert adaptive.value == pytest.approx(0.101)
    adaptive.update(current_kl=5.4, n_steps=500)
    assert adaptive.value == pytest.approx(0.100495)


def test_adaptive_kl_needs_a_positive_start_coefficient() -> None:
    # The adaptive update multiplies the coefficient, so a start at 0 would stay 0 forever.
    AlgorithmArguments(adaptive_kl_target=6.0, kl_penalty_coef=0.05)
    with pytest.raises(ConfigError, match=r"algorithm\.kl_penalty_coef=0.*algorithm\.adaptive_kl_target"):
        AlgorithmArguments(adaptive_kl_target=6.0, kl_penalty_coef=0.0)


def test_k1_as_a_kl_loss_has_zero_expected_gradient_and_is_refused() -> None:
    # The exact expectation over a 3-token policy p of each estimator's gradient (the samples are not differentiated).
    logits = torch.tensor([0.3, -1.0, 2.0], requires_grad=True)
    ref_log_probs = torch.log_softmax(torch.tensor([1.0, 0.0, -0.5]), -1)

    def expected_gradient(kind: str) -> torch.Tensor:
        log_probs = torch.log_softmax(logits, -1)
        loss = (log_probs.exp().detach() * kl_estimate(log_probs, ref_log_probs, kind)).sum()
        return torch.autograd.grad(loss, logits)[0]

    assert torch.allclose(expected_gradient("k1"), torch.zeros(3), atol=1e-7)
    assert expected_gradient("k2").abs().max() > 0.1 and expected_gradient("k3").abs().max() > 0.1
    message = r"^algorithm\.kl_loss_kind=k1 with algorithm\.use_kl_loss=true: .*zero expected gradient.*use k3 .* or k2"
    with pytest.raises(ConfigError, match=message):
        AlgorithmArguments(use_kl_loss=True, kl_loss_coef=0.04, kl_loss_kind="k1")
    AlgorithmArguments(use_kl_loss=True, kl_loss_coef=0.04, kl_loss_kind="k2")
    AlgorithmArguments(kl_penalty_coef=0.04, kl_penalty_kind="k1")  # the reward penalty's usual estimator


def test_kl_clamped_log_ratio_and_k3() -> None:
    # The log-ratio d is clamped to [-20, 20], then k3 to [-10, 10]:
    #   d = -30 -> -20 -> exp(20) - 21 ~ 4.85e8 -> 10;  d = 30 -> 20 -> exp(-20) + 19 ~ 19 -> 10;
    #   d = -2 -> exp(2) - 3;  d = 1 -> exp(-1).  k1 and k2 see the clamped d: -20 and 200.
    logp = t(-35.0, 25.0, -7.0, -4.0)
    ref = t(-5.0, -5.0, -5.0, -5.0)
    close(kl_estimate(logp, ref, "k3"), [10.0, 10.0, math.exp(2.0) - 3.0, math.exp(-1.0)])
    close(kl_estimate(logp, ref, "k1"), [-20.0, 20.0, -2.0, 1.0])
    close(kl_estimate(logp, ref, "k2"), [200.0, 200.0, 2.0, 0.5])
    close(kl_estimate(t(-math.inf), t(-5.0), "k3"), [10.0])


@pytest.mark.parametrize("masked_logp", [-100.0, -math.inf])
@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs"])
def test_masked_garbage_log_probs_contribute_exactly_zero(kind: str, masked_logp: float) -> None:
    # A masked position with log-prob -100 against -5 used to give k3 = exp(95) = inf in float32, and inf * 0 = nan,
    # even at penalty coefficient 0. In-mask tokens have d = 0 (KL 0), so the rewards and every KL are exact.
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, -1.0, 0.0]])
    ref = torch.tensor([[-1.0, -2.0, -5.0], [-1.0, -1.0, -5.0]])
    logp = torch.tensor([[-1.0, -2.0, masked_logp], [-1.0, -1.0, masked_logp]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    for coef in (0.0, 0.1):
        penalised, mean_kl = apply_kl_penalty(rewards, logp, ref, mask, coef=coef, kind=kind)
        close(penalised, [[0.0, 1.0, 0.0], [0.0, -1.0, 0.0]])
        close(mean_kl, [0.0, 0.0])
    logp.requires_grad_()
    loss = kl_loss(logp, ref, mask, kind)
    close(loss.detach(), 0.0)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    close(logp.grad[:, 2], [0.0, 0.0])


def test_apply_kl_penalty() -> None:
    # k1 per token: [0.5, -1, 2 (masked)] and [1, 1, 1]; coef 0.1. The masked position's reward 4 is not
    # penalised and passes unchanged (only an empty response puts its score outside the mask).
    rewards = t([0.0, 1.0, 4.0], [0.0, 0.0, 2.0])
    logp = t([-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0])
    ref = t([-1.5, -1.0, -2.0], [-2.0, -2.0, -2.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    penalised, mean_kl = apply_kl_penalty(rewards, logp, ref, mask, coef=0.1, kind="k1")
    close(penalised, [[-0.05, 1.1, 4.0], [-0.1, -0.1, 1.9]])
    close(mean_kl, [-0.25, 1.0])


# --- PPO losses -------------------------------------------------------------------------------------------


def test_aggregation_modes_differ_on_unequal_lengths() -> None:
    # Row 0 tokens [1, 2, 3], row 1 token [4]; row 2 fully masked (skipped by the sequence means).
    loss_mat = t([1.0, 2.0, 3.0], [4.0, 100.0, 100.0], [100.0, 100.0, 100.0])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    close(aggregate_loss(loss_mat, mask, "token-mean"), 2.5)  # 10 / 4
    close(aggregate_loss(loss_mat, mask, "seq-mean-token-mean"), 3.0)  # (2 + 4) / 2
    close(aggregate_loss(loss_mat, mask, "seq-mean-token-sum"), 5.0)  # (6 + 4) / 2
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_loss(loss_mat, mask, "sum")  # type: ignore[arg-type]


def test_policy_loss_asymmetric_clip_both_sides() -> None:
    # clip range [0.8, 1.28]; old logp 0, so ratio = exp(logp).
    #   A=+1, r=1.5: max(-1.5, -1.28) = -1.28  clipped (upper)
    #   A=-1, r=0.5: max( 0.5,  0.8 ) =  0.8   clipped (lower)
    #   A=+1, r=1.1: -1.1                      inside
    #   A=-1, r=1.5: max( 1.5,  1.28) =  1.5   unclipped (pessimistic side)
    #   A=+2, r=0.5: max(-1.0, -1.6 ) = -1.0   unclipped (pessimistic side)
    # token-mean = -1.08 / 5 = -0.216; clipfrac 2/5; ratio mean 5.1/5; approx_kl = mean(-ln r).
    ratios = t([1.5, 0.5, 1.1], [1.5, 0.5, 1.0])
    advantages = t([1.0, -1.0, 1.0], [-1.0, 2.0, 0.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    logp = ratios.log().requires_grad_()
    loss, metrics = policy_loss(logp, torch.zeros_like(logp), advantages, mask, clip_low=0.2, clip_high=0.28)
    close(loss, -0.216)
    close(metrics["clipfrac"], 0.4)
    close(metrics["ratio_mean"], 1.02)
    close(metrics["approx_kl"], -math.log(1.5 * 0.5 * 1.1 * 1.5 * 0.5) / 5)
    close(metrics["dual_clipfrac"], 0.0)
    loss.backward()
    # Clipped tokens get no gradient; unclipped ones get -A * r / 5.
    close(logp.grad, [[0.0, 0.0, -1.1 / 5], [1.5 / 5, -1.0 / 5, 0.0]])


def test_policy_loss_dual_clip() -> None:
    # dual_clip 3, clip 0.2. A=-1, r=5: max(5, 1.2) = 5 -> bounded to 3. A=-1, r=2: 2 < 3 kept.
    # A=+1, r=5: max(-5, -1.2) = -1.2 (dual clip only acts on A < 0). Mean (3 + 2 - 1.2) / 3.
    logp = t([math.log(5.0), math.log(2.0), math.log(5.0)])
    advantages = t([-1.0, -1.0, 1.0])
    mask = torch.ones(1, 3)
    loss, metrics = policy_loss(logp, torch.zeros_like(logp), advantages, mask, dual_clip=3.0)
    close(loss, 3.8 / 3)
    close(metrics["dual_clipfrac"], 1 / 3)
    close(metrics["clipfrac"], 1 / 3)
    with pytest.raises(ValueError, match="> 1"):
        policy_loss(logp, logp, advantages, mask, dual_clip=1.0)


def test_value_loss_clip() -> None:
    # old V 1, clip 0.2.  V=1.5, R=2: clipped V 1.2 -> 0.5*max(0.25, 0.64) = 0.32 (clip binds).
    # V=1.5, R=0: 0.5*max(2.25, 1.44) = 1.125.  V=0.9, R=0: inside the range -> 0.5*0.81 = 0.405.
    values = t([1.5, 1.5, 0.9, 42.0])
    old_values = t([1.0, 1.0, 1.0, 0.0])
    returns = t([2.0, 0.0, 0.0, 0.0])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = value_loss(values, old_values, returns, mask, clip=0.2)
    close(loss, (0.32 + 1.125 + 0.405) / 3)
    close(metrics["clipfrac"], 1 / 3)
    # Unclipped: 0.5 * (0.25 + 2.25 + 0.81) / 3.
    loss, metrics = value_loss(values, old_values, returns, mask, clip=None)
    close(loss, 0.5 * 3.31 / 3)
    close(metrics["clipfrac"], 0.0)


def test_entropy_from_logits() -> None:
    # Uniform over V = 7 -> ln 7, also at logits where a naive exp overflows. [0, ln 3]: p = [1/4, 3/4]
    # -> ln 4 - (3/4) ln 3.
    close(entropy_from_logits(torch.zeros(2, 7)), [math.log(7.0)] * 2)
    close(entropy_from_logits(torch.full((7,), 1000.0)), math.log(7.0), atol=1e-3)
    close(entropy_from_logits(t(0.0, math.log(3.0))), math.log(4.0) - 0.75 * math.log(3.0))
    assert entropy_from_logits(torch.zeros(3, 5, 11, dtype=torch.bfloat16)).dtype == torch.float32


def test_kl_loss_reuses_estimator_and_aggregation() -> None:
    # k1 per token [1, 3 | 2, masked]: token-mean 6/3 = 2, seq-mean-token-mean (2 + 2)/2 = 2,
    # seq-mean-token-sum (4 + 2)/2 = 3.
    logp = t([1.0, 3.0], [2.0, 9.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    close(kl_loss(logp, torch.zeros_like(logp), mask, "k1", "token-mean"), 2.0)
    close(kl_loss(logp, torch.zeros_like(logp), mask, "k1", "seq-mean-token-sum"), 3.0)
    # k2 per token [0.5, 4.5 | 2]: token-mean 7/3.
    close(kl_loss(logp, torch.zeros_like(logp), mask, "k2"), 7.0 / 3)


# --- score processing -------------------------------------------------------------------------------------


def test_group_stats() -> None:
    mean, std, count = group_stats(t(1.0, 10.0, 3.0, 7.0), torch.tensor([5, 2, 5, 9]))
    close(mean, [2.0, 10.0, 2.0, 7.0])
    close(std, [math.sqrt(2.0), 0.0, math.sqrt(2.0), 0.0])  # [1, 3]: ((-1)^2 + 1^2) / (2 - 1) = 2
    close(count, [2.0, 1.0, 2.0, 1.0])


def test_normalize_scores_modes() -> None:
    scores = t(1.0, 0.0, 3.0, 4.0)
    group_index = torch.tensor([0, 1, 0, 1])
    close(normalize_scores(scores, group_index, "none"), [1.0, 0.0, 3.0, 4.0])
    # Groups [1, 3] and [0, 4]: means 2, 2; stds sqrt(2), sqrt(8) = 2 sqrt(2).
    s2 = math.sqrt(2.0)
    close(normalize_scores(scores, group_index, "group", eps=0.0), [-1 / s2, -1 / s2, 1 / s2, 1 / s2])
    close(normalize_scores(scores, group_index, "group", norm_by_std=False), [-1.0, -2.0, 1.0, 2.0])
    # Batch: mean 2, squared deviations 1+4+1+4 = 10, unbiased var 10/3.
    std = math.sqrt(10.0 / 3.0)
    close(normalize_scores(scores, None, "batch", eps=0.0), [-1 / std, -2 / std, 1 / std, 2 / std])
    with pytest.raises(ValueError, match="group_index"):
        normalize_scores(scores, None, "group")
    with pytest.raises(ValueError, match="'none', 'group', 'batch'"):
        normalize_scores(scores, group_index, "rank")  # type: ignore[arg-type]


def test_clip_scores() -> None:
    close(clip_scores(t(-3.0, 0.5, 9.0), -1.0, 1.0), [-1.0, 0.5, 1.0])
    close(clip_scores(t(-3.0, 9.0), None, 1.0), [-3.0, 1.0])
    with pytest.raises(ValueError, match="low"):
        clip_scores(t(0.0), 1.0, -1.0)


def test_dynamic_sampling_keep() -> None:
    # Group 0 [1, 1, 1] and the singleton group 3 carry no signal; group 1 [0, 1] and group 2 [0.1, 0.1 + 1e-9] do.
    scores = t(1.0, 0.0, 1.0, 1.0, 0.1, 0.1 + 1e-9, 0.5)
    group_index = torch.tensor([0, 1, 0, 1, 2, 2, 3])
    keep = dynamic_sampling_keep(scores, group_index)
    assert keep.tolist() == [False, True, False, True, True, True, False]
    # Exact equality: 0.1 three times is constant even though its float mean is not exactly 0.1.
    assert not dynamic_sampling_keep(t(0.1, 0.1, 0.1), torch.zeros(3, dtype=torch.long)).any()


def test_group_index_from_repeat() -> None:
    assert group_index_from_repeat(3, 2).tolist() == [0, 0, 1, 1, 2, 2]
    assert group_index_from_repeat(3, 2, interleave=False).tolist() == [0, 1, 2, 0, 1, 2]
