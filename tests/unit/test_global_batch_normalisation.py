"""Losses normalise over the global optimizer step, every data-parallel rank's rows, by numbers computed by hand.

DeepSpeed averages the data-parallel ranks' gradients, so a rank normalising its loss over its own tokens
would weigh a token by 1 / (ranks x its rank's tokens) instead of 1 / (the step's tokens). The step's counts
are summed over the ranks (`step_counts`) and each micro-batch's loss is scaled by its share of them
(`step_normalised`). Here the ranks are simulated in one process: the collective is a sum with the other
ranks' counts, the engine's averaging a mean over the ranks' back-propagated losses.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from roll.algorithms.policy_losses import aggregate_loss
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.hf_compute import optimizer_step_losses
from roll.distributed.strategy.micro_batches import SINGLE_RANK, DataParallel, step_counts, step_normalised
from roll.distributed.strategy.strategy import DATA_PARALLEL_SIZE, MICRO_BATCHES_IN_STEP, STEP_COUNTS

# Two rows per rank. Rank 0 has 2 masked-in tokens, in one of its rows (the other is empty), each with loss 1;
# rank 1 has 4 tokens in its two rows, each with loss 4.
RANK_MASKS = [torch.tensor([[1, 1, 0], [0, 0, 0]]), torch.tensor([[1, 1, 1], [1, 0, 0]])]
RANK_LOSSES = [1.0, 4.0]
# Over the 4 rows on one rank: token-mean (2 x 1 + 4 x 4) / 6 tokens; seq-mean-token-sum over the 3 non-empty
# rows (2 + 12 + 4) / 3; seq-mean-token-mean (1 + 4 + 4) / 3; seq-mean-token-sum-norm the sums over 3 columns.
GLOBAL = {"token-mean": 3.0, "seq-mean-token-sum": 6.0, "seq-mean-token-mean": 3.0, "seq-mean-token-sum-norm": 2.0}
# What each rank normalising over its own rows gave (the mean of the ranks' own aggregates): 2.5, 5, 2.5, 5/3.
PER_RANK = {"token-mean": 2.5, "seq-mean-token-sum": 5.0, "seq-mean-token-mean": 2.5, "seq-mean-token-sum-norm": 5 / 3}


@dataclass(frozen=True)
class SimulatedRanks(DataParallel):
    """The collective of `size` ranks stood in for: this rank's counts plus the other ranks' (given)."""

    others: tuple[torch.Tensor, ...] = ()

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        return values + sum(self.others)


def rank_batch(mask: torch.Tensor, loss: float, mask_key: str) -> DataProto:
    """A rank's rows: `mask` under `mask_key` (the response mask all ones otherwise) and per-token `losses`."""
    tensors = {
        "input_ids": torch.ones(len(mask), 5, dtype=torch.long),
        "attention_mask": torch.ones(len(mask), 5, dtype=torch.long),
        "responses": torch.ones_like(mask),
        "response_mask": mask if mask_key == "response_mask" else torch.ones_like(mask),
        "losses": torch.full(mask.shape, loss),
    }
    if mask_key != "response_mask":
        tensors[mask_key] = mask
    return DataProto.from_dict(tensors=tensors)


def engine_loss(rank_batches: list[DataProto], mode: str, mask_key: str, micro_batch_size: int) -> float:
    """The loss whose gradient the engine applies: each rank back-propagates its micro-batches' losses (the
    strategy divides each by their count), the engine averages the ranks' gradients."""

    def loss_func(micro_batch: DataProto, output: None) -> tuple[torch.Tensor, dict]:
        data = micro_batch.batch
        loss = aggregate_loss(data["losses"], data[mask_key], mode, norm_length=3)
        return step_normalised(loss, micro_batch, mode, mask_key), {}

    ranks = len(rank_batches)
    own_counts = [torch.tensor(list(step_counts(batch, SINGLE_RANK).values())) for batch in rank_batches]
    total = 0.0
    for rank, batch in enumerate(rank_batches):
        others = tuple(counts for other, counts in enumerate(own_counts) if other != rank)
        data_parallel = SimulatedRanks(size=ranks, others=others)
        losses = optimizer_step_losses(
            lambda **_: None, batch, loss_func, micro_batch_size, "cpu", data_parallel=data_parallel
        )
        total += sum(loss.item() for loss, _, _ in losses) / ranks
    return total


@pytest.mark.parametrize("mode", GLOBAL)
@pytest.mark.parametrize("mask_key", ["response_mask", "step_mask"])
def test_two_ranks_give_the_loss_over_all_their_rows(mode: str, mask_key: str) -> None:
    rank_batches = [rank_batch(mask, loss, mask_key) for mask, loss in zip(RANK_MASKS, RANK_LOSSES, strict=True)]
    assert engine_loss(rank_batches, mode, mask_key, micro_batch_size=1) == pytest.approx(GLOBAL[mode])
    assert GLOBAL[mode] != pytest.approx(PER_RANK[mode])  # what normalising per rank gave differs
    one_rank = DataProto.concat(rank_batches)
    for micro_batch_size in (1, 2, 4):
        assert engine_loss([one_rank], mode, mask_key, micro_batch_size) == pytest.approx(GLOBAL[mode])


def test_step_counts_are_summed_over_the_ranks() -> None:
    batch = rank_batch(RANK_MASKS[0], 1.0, "step_mask")
    other = torch.tensor(list(step_counts(rank_batch(RANK_MASKS[1], 4.0, "step_mask"), SINGLE_RANK).values()))
    counts = step_counts(batch, SimulatedRanks(size=2, others=(other,)))
    # The response masks are all ones: 6 tokens and 2 rows per rank; the step masks 2 + 4 tokens, 1 + 2 rows.
    assert counts["response_mask", "token-mean"] == 12 and counts["response_mask", "seq-mean-token-sum"] == 4
    assert counts["step_mask", "token-mean"] == 6 and counts["step_mask", "seq-mean-token-mean"] == 3


def test_step_normalised_scales_by_the_share_the_micro_batches_and_the_ranks() -> None:
    """n / N x M x D: a micro-batch of 3 tokens in one row, of a step of 10 tokens in 5 rows over 2 ranks, this
    rank's part in 2 micro-batches."""
    micro_batch = DataProto.from_dict(
        tensors={"response_mask": torch.tensor([[1, 1, 1, 0]])},
        meta_info={
            STEP_COUNTS: {("response_mask", "token-mean"): 10.0, ("response_mask", "seq-mean-token-mean"): 5.0},
            MICRO_BATCHES_IN_STEP: 2,
            DATA_PARALLEL_SIZE: 2,
        },
    )
    loss = torch.tensor(0.5)
    assert step_normalised(loss, micro_batch, "token-mean").item() == pytest.approx(0.5 * 3 / 10 * 2 * 2)
    assert step_normalised(loss, micro_batch, "seq-mean-token-mean").item() == pytest.approx(0.5 * 1 / 5 * 2 * 2)
    # A forward pass's micro-batch carries no step: the loss is its own.
    plain = DataProto.from_dict(tensors={"response_mask": torch.tensor([[1, 1, 1, 0]])})
    assert step_normalised(loss, plain, "token-mean") is loss
