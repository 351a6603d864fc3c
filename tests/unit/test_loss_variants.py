"""Loss variants of current practice (DAPO, Dr. GRPO, GSPO, TIS) against hand-computed numbers."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from roll.algorithms import policy_losses
from roll.algorithms.advantages import grpo_advantages
from roll.algorithms.reward_shaping import overlong_penalty
from roll.configs.algorithm_config import AlgorithmArguments
from roll.configs.schema import ConfigError
from roll.configs.worker_config import GeneratingArguments, StrategyArguments
from roll.pipeline.rlvr.rlvr_config import RLVRConfig

MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


def test_seq_mean_token_sum_norm_divides_by_a_constant_not_each_length():
    """Dr. GRPO: (sum_1 / L + sum_2 / L) / 2 with L the maximum response length, not each sequence's length."""
    loss_mat = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0]])
    # Sums 6 and 4 (the 99s are masked out).
    assert policy_losses.aggregate_loss(loss_mat, MASK, "seq-mean-token-sum-norm", 10).item() == pytest.approx(0.5)
    assert policy_losses.aggregate_loss(loss_mat, MASK, "seq-mean-token-sum-norm").item() == pytest.approx(1.25)
    # The per-length normalisation it replaces: (6/3 + 4/1) / 2.
    assert policy_losses.aggregate_loss(loss_mat, MASK, "seq-mean-token-mean").item() == pytest.approx(3.0)


def test_dr_grpo_advantages_only_centre_the_group():
    """norm_adv_by_std=False: scores 1, 0, 0, 1 in one group -> 0.5, -0.5, -0.5, 0.5 (no division by std)."""
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    advantages, _ = grpo_advantages(rewards, torch.ones(4, 2), group_index=torch.zeros(4), norm_by_std=False)
    assert advantages[:, 0].tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5])


def test_gspo_ratio_is_the_geometric_mean_clipped_per_sequence():
    """Sequence 1: log-ratios 0.1, 0.3 -> ratio e^0.2, inside the clip; sequence 2: 0.6, 0.4, 0.5 -> e^0.5, clipped."""
    old = torch.zeros(2, 4)
    # Position 3 of row 0 is masked out and holds garbage that must not count.
    new = torch.tensor([[0.1, 0.3, 0.0, 50.0], [0.6, 0.4, 0.5, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    advantages = torch.ones(2, 4)
    loss, metrics = policy_losses.policy_loss(
        new, old, advantages, mask, clip_high=0.28, agg_mode="seq-mean-token-mean", importance_level="sequence"
    )
    s1 = math.exp(0.2)
    assert loss.item() == pytest.approx((-s1 - 1.28) / 2)
    # Three of five tokens belong to the clipped sequence.
    assert metrics["clipfrac"].item() == pytest.approx(3 / 5)
    loss.backward()
    # d/d logp_1t of -(1/2) * exp(mean_t logp_1t) = -s1 / (2 * 2) on both tokens; the clipped sequence gets none.
    assert new.grad[0].tolist() == pytest.approx([-s1 / 4, -s1 / 4, 0.0, 0.0])
    assert new.grad[1].tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0])


def test_gspo_does_not_clip_a_token_whose_sequence_ratio_is_inside():
    """Token log-ratios +0.5, -0.5: token-level clips the first, sequence-level sees ratio e^0 = 1 and clips nothing."""
    new, old = torch.tensor([[0.5, -0.5]]), torch.zeros(1, 2)
    advantages, mask = torch.ones(1, 2), torch.ones(1, 2)
    _, token_metrics = policy_losses.policy_loss(new, old, advantages, mask, importance_level="token")
    loss, seq_metrics = policy_losses.policy_loss(new, old, advantages, mask, importance_level="sequence")
    assert token_metrics["clipfrac"].item() == pytest.approx(0.5)
    assert seq_metrics["clipfrac"].item() == 0.0
    assert loss.item() == pytest.approx(-1.0)


def test_tis_weights_are_truncated_ratios_of_trainer_to_engine():
    """exp(0 - (-0.5)) = e^0.5 ~ 1.65 capped at 1.5; exp(-1 - 0) = e^-1; masked positions weigh 0."""
    old = torch.tensor([[0.0, -1.0, 3.0]])
    engine = torch.tensor([[-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights = policy_losses.tis_weights(old, engine, mask, cap=1.5)
    assert weights[0].tolist() == pytest.approx([1.5, math.exp(-1.0), 0.0])


def test_tis_metrics_report_mean_max_and_clipped_fraction_of_masked_tokens():
    """Ratios e^0.5 (clipped to 1.5), e^-1, and e^3 under the mask (ignored): mean, max 1.5, half clipped."""
    old = torch.tensor([[0.0, -1.0, 3.0]])
    engine = torch.tensor([[-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    metrics = policy_losses.tis_metrics(old, engine, mask, cap=1.5)
    assert metrics["tis_weight_mean"].item() == pytest.approx((1.5 + math.exp(-1.0)) / 2)
    assert metrics["tis_weight_max"].item() == pytest.approx(1.5)
    assert metrics["tis_clipped_fraction"].item() == pytest.approx(0.5)
    empty = policy_losses.tis_metrics(old, engine, torch.zeros(1, 3), cap=1.5)
    assert all(value.item() == 0.0 for value in empty.values())


def test_tis_weights_scale_the_policy_loss_and_carry_no_gradient():
    """Ratio 1, A = 2: token losses -2 x weights; token-mean (-2 * 1.5 - 2 * e^-1) / 2."""
    old = torch.tensor([[0.0, -1.0]], requires_grad=True)
    engine = torch.tensor([[-0.5, 0.0]])
    mask = torch.ones(1, 2)
    weights = policy_losses.tis_weights(old, engine, mask, cap=1.5)
    assert not weights.requires_grad
    new = old.detach().clone().requires_grad_(True)
    loss, _ = policy_losses.policy_loss(new, old.detach(), torch.full((1, 2), 2.0), mask, token_weights=weights)
    assert loss.item() == pytest.approx(-(1.5 + math.exp(-1.0)))
    loss.backward()
    assert new.grad[0].tolist() == pytest.approx([-1.5, -math.exp(-1.0)])


def test_overlong_penalty_is_linear_over_the_buffer():
    """max 10, buffer 4: no penalty up to 6 tokens, then -(L - 6) / 4 x factor, -factor at 10."""
    lengths = torch.tensor([5, 6, 7, 10])
    assert overlong_penalty(lengths, 10, 4, 1.0).tolist() == pytest.approx([0.0, 0.0, -0.25, -1.0])
    assert overlong_penalty(lengths, 10, 4, 0.5).tolist() == pytest.approx([0.0, 0.0, -0.125, -0.5])
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, 10, 11, 1.0)


def _loss_variant_check(strategy: str, temperature: float = 1.0, **algorithm: object) -> None:
    """RLVRConfig's loss-variant check on just the fields it reads."""
    actor_infer = SimpleNamespace(
        generating_args=GeneratingArguments(max_new_tokens=8, temperature=temperature),
        strategy_args=StrategyArguments(strategy_name=strategy),
    )
    RLVRConfig._check_loss_variants(SimpleNamespace(algorithm=AlgorithmArguments(**algorithm), actor_infer=actor_infer))


def test_tis_needs_an_engine_that_returns_its_log_probs():
    """hf_infer and vllm return their samples' log-probs, deepspeed_infer does not; none at the sampling temperature."""
    _loss_variant_check("vllm", tis_cap=2.0)
    _loss_variant_check("hf_infer", tis_cap=2.0)
    _loss_variant_check("deepspeed_infer")
    with pytest.raises(ConfigError, match=r"algorithm\.tis_cap.*'deepspeed_infer'.*hf_infer, vllm or sglang"):
        _loss_variant_check("deepspeed_infer", tis_cap=2.0)
    with pytest.raises(ConfigError, match=r"algorithm\.log_prob_temperature=one"):
        _loss_variant_check("vllm", temperature=0.7, tis_cap=2.0, log_prob_temperature="sampling")


def test_overlong_buffer_fits_in_the_generation_budget():
    """A buffer longer than max_new_tokens (8) would penalise every response."""
    _loss_variant_check("hf_infer", overlong_buffer_len=8)
    with pytest.raises(ConfigError, match=r"algorithm\.overlong_buffer_len=9.*max_new_tokens=8"):
        _loss_variant_check("hf_infer", overlong_buffer_len=9)
